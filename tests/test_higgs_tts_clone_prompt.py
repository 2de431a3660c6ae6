"""Higgs Audio v2 voice cloning against the reference (higgs-tts-tiny, CPU fp32, random weights and
codebooks): a clip's prompt rows equal what transformers' processor builds for the conversation
system, scene, user (the clip's transcript), assistant (the clip), user (the text): the chat
template rendered and tokenized, `<|AUDIO_OUT|>` expanded by the processor's `get_audio_tokens`,
the clip's codes from the reference tokenizer's `encode`, framed and delayed by the processor's
`build_delay_pattern`; the clip's rows take the audio embedding and the audio feed-forward path
(DualFFN) row by row, in a prefill alone and beside text prompts and decode rows; and greedy rows
through the engine equal `HiggsAudioV2ForConditionalGeneration.generate` given the same input ids
and audio ids, alone and among other requests, and the graph runner's (prefill graphs holding clip
rows; CPU stand-ins) equal the eager runner's. The reference decodes only the generated rows (from
the last all-bos row), so a cloned request's codec stream is not primed (`codec_prefix` None)."""

from __future__ import annotations

import math
import re

import jinja2
import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs.base import Reference, Voice
from programs.higgs_tts import spec as h
from programs.higgs_tts.program import clip_rows
from tests.engine_runs import graph_engine
from tests.higgs_tts_reference import reference_lm, repetition_aware
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)
from tests.test_higgs_tts_clone_encoder import _clip, reference_encoder
from tests.test_higgs_tts_parity import as_reference, program  # noqa: F401 (fixture)
from tests.test_higgs_tts_prompt import CHAT_TEMPLATE, SPECIAL

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REF_TEXT = "  It was the night before my birthday.  "
TEXT = "The sun rises in the east."
BUDGET = 60


@pytest.fixture(scope="module")
def cloning(program):  # noqa: F811
    program.load_codec()
    program.load_encoders()
    return program


@pytest.fixture(scope="module")
def ref_tok(cloning):
    return reference_encoder(cloning.encoder, cloning.config_path("codec_config"))


def reference_processor(ref_tok):
    """transformers' HiggsAudioV2Processor holding only what `get_audio_tokens` and
    `build_delay_pattern` read (the default token names and stream ids)."""
    from transformers import HiggsAudioV2Processor

    proc = object.__new__(HiggsAudioV2Processor)
    proc.audio_token, proc.audio_delay_token = "<|AUDIO_OUT|>", "<|reserved_special_token_6|>"
    proc.audio_stream_bos_id, proc.audio_stream_eos_id = h.STREAM_BOS, h.STREAM_EOS
    proc.audio_tokenizer = ref_tok
    return proc


def reference_inputs(prog, ref_tok, clip: torch.Tensor, ref_text: str, text: str, scene: str):
    """(input_ids [L], audio_input_ids [A, 8]) the processor builds for the cloning conversation."""
    proc = reference_processor(ref_tok)
    with torch.no_grad():
        codes = ref_tok.encode(clip[None, None], return_dict=False)  # [1, 8, T]
    framed = torch.cat(
        [torch.full((1, 8, 1), h.STREAM_BOS), codes, torch.full((1, 8, 1), h.STREAM_EOS)], dim=2
    )
    audio_ids = proc.build_delay_pattern(framed)[0].T  # [T + 9, 8]
    messages = [
        {"role": "system", "content": h.SYSTEM_MESSAGE},
        {"role": "scene", "content": scene},
        {"role": "user", "content": ref_text},
        {"role": "assistant", "content": [{"type": "audio", "url": "clip.wav"}]},
        {"role": "user", "content": text},
    ]
    rendered = (
        jinja2.Environment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=True)
    )
    rendered = rendered.replace(proc.audio_token, proc.get_audio_tokens(len(audio_ids)))
    special = {
        **SPECIAL,
        h.SCENE_START: prog._marker(h.SCENE_START),
        h.SCENE_END: prog._marker(h.SCENE_END),
        h.AUDIO_EOS: prog._marker(h.AUDIO_EOS),
        proc.audio_token: h.AUDIO_OUT,
        proc.audio_delay_token: h.AUDIO_DELAY,
    }
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, special)) + ")", rendered):
        ids += [special[piece]] if piece in special else prog._tokenizer.text_ids(piece) if piece else []
    return torch.tensor(ids), audio_ids


def voice_of(prog, clip: torch.Tensor, ref_text: str) -> Voice:
    (features,) = prog.encode_references([Reference(clip.numpy(), ref_text)])
    return Voice(features, ref_text)


@pytest.mark.parametrize("seconds, scene", [(1.0, h.DEFAULT_SCENE), (3.3, "SPEAKER0: warm")])
def test_prompt_rows_are_the_processors_ids_and_audio_ids(cloning, ref_tok, seconds, scene):
    clip = _clip(seconds, 11)
    voice = voice_of(cloning, clip, REF_TEXT)
    assert voice.features["codes"].shape == (math.ceil(len(clip) / 960), 8)
    rows = cloning.preprocess(TEXT, {"scene": scene}, voice).rows
    ids, audio_ids = reference_inputs(cloning, ref_tok, clip, REF_TEXT, TEXT, scene)
    is_audio = (ids == h.AUDIO_OUT) | (ids == h.AUDIO_DELAY)
    assert len(rows) == len(ids) and int(is_audio.sum()) == len(audio_ids) == math.ceil(len(clip) / 960) + 9
    np.testing.assert_array_equal(rows[~is_audio.numpy()], np.pad(ids[~is_audio][:, None], ((0, 0), (0, 7))))
    np.testing.assert_array_equal(rows[is_audio.numpy()], audio_ids.numpy() + h.PROMPT_AUDIO)
    assert cloning.check_prompt(rows, {}) == ""
    assert cloning.codec_prefix({}) is None
    extra = cloning.option_rows({"scene": scene}, voice)
    assert len(rows) == len(cloning.preprocess(TEXT, {}).rows) + extra


def test_clip_rows_and_bad_voices(cloning):
    codes = np.arange(16).reshape(2, 8) % 1024
    rows = clip_rows(codes) - h.PROMPT_AUDIO
    assert rows.shape == (11, 8) and (rows[0] == h.STREAM_BOS).all() and (rows[-1] == h.STREAM_EOS).all()
    assert [rows[1 + k, k] for k in range(8)] == list(codes[0])
    for bad, match in [
        (Voice({"codes": np.zeros((3, 7), np.int32)}, "x"), "codes"),
        (Voice({"codes": np.full((3, 8), 1024, np.int32)}, "x"), "codes"),
        (Voice({"codes": np.zeros((3, 8), np.int32)}, "  "), "transcript"),
    ]:
        with pytest.raises(ValueError, match=match):
            cloning.preprocess(TEXT, {}, bad)
    rows = cloning.preprocess(TEXT, {}, Voice({"codes": np.zeros((2, 8), np.int32)}, "Hi.")).rows
    bad = rows.copy()
    bad[np.flatnonzero(rows[:, 1] >= h.PROMPT_AUDIO)[0], 3] = 7
    assert "audio row" in cloning.check_prompt(bad, {})


def run(prog, prompts: list[Prompt], runner_cls=None) -> dict:
    """The engine's outputs (through `runner_cls`, the CPU stand-in for the GPU graph runner, where
    given), request i joining after 3i steps."""
    limits = dict(max_batch_size=4, max_context=600)
    eng = Engine(prog, GpuWorkerSettings(**limits))
    if runner_cls is not None:
        eng = graph_engine(prog, runner_cls, limits)
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        for _ in range(i * 3):  # later requests join a batch that is already decoding
            eng.step()
    eng.run_until_idle()
    assert eng.allocator.num_used == 0
    return eng.outputs


def test_greedy_rows_equal_the_reference_generate_given_the_clip(cloning, ref_tok, graph_runner_cls):  # noqa: F811
    ref = reference_lm(cloning.lm)
    flush = cloning.flush_rows
    cases = {"c1": (_clip(1.4, 3), "Hello there, how are you?"), "c2": (_clip(2.6, 4), TEXT)}
    want, prompts = {}, []
    for rid, (clip, text) in cases.items():
        ids, audio_ids = reference_inputs(cloning, ref_tok, clip, REF_TEXT, text, h.DEFAULT_SCENE)
        with torch.no_grad(), repetition_aware(ref, [0]):  # the window opens on the clip's last rows
            out = ref.generate(
                input_ids=ids[None],
                audio_input_ids=audio_ids[None],
                audio_input_ids_mask=torch.ones(1, len(audio_ids), dtype=torch.bool),
                max_new_tokens=BUDGET,
                do_sample=False,
            )[0].numpy()
        want[rid] = out[len(audio_ids) :]  # the generated rows after the clip's
        rows = np.asarray(cloning.preprocess(text, {}, voice_of(cloning, clip, REF_TEXT)).rows, "<i4")
        sp = SamplingParams(max_tokens=len(rows) + BUDGET + flush, temperature=0.0)
        prompts.append(Prompt(rid, rows.tobytes(), len(rows), sp))
    plain = cloning.preprocess("Thank you so much.", {}).rows.astype("<i4")
    other = Prompt(
        "t", plain.tobytes(), len(plain), SamplingParams(max_tokens=len(plain) + 30, temperature=0.0)
    )
    assert len(set(map(len, want.values()))) == 2 and any(
        (w[-1] == h.STREAM_EOS).all() for w in want.values()
    )
    alone = run(cloning, prompts[:1])
    crowd = run(cloning, [other, prompts[1], prompts[0]])
    graphs = run(cloning, [other, prompts[1], prompts[0]], graph_runner_cls)  # prefill graphs hold clip rows
    assert graphs == crowd
    for rid, w in want.items():
        for outputs in ([alone] if rid == "c1" else []) + [crowd]:
            rows, reason = outputs[rid]
            np.testing.assert_array_equal(as_reference(np.array(rows)[: len(w)]), w, err_msg=rid)
            if (w[-1] == h.STREAM_EOS).all():
                assert reason == FinishReason.STOP and len(rows) == len(w) + flush - 1


def test_a_prefill_without_the_split_flags_the_clip_rows_alike(cloning):
    """The step's prompt rows given (`prompt_rows`) or told by the step alone: equal hidden states,
    the clip's rows flagged for the audio path either way."""
    from gpu_worker.attention.interface import StepLayout
    from gpu_worker.attention.torch_paged import TorchPagedAttention
    from gpu_worker.runner.kv_cache import allocate_kv_cache
    from programs.base import Rows

    rows = cloning.preprocess(TEXT, {}, voice_of(cloning, _clip(1.2, 9), REF_TEXT)).rows
    n = len(rows)
    ids, pos = torch.from_numpy(rows.astype(np.int64)), torch.arange(n)
    step, slot = torch.arange(-n, 0), torch.zeros(n, dtype=torch.int64)
    pages = [list(range(1, 1 + -(-n // 16)))]
    out = []
    for given in (n, None):
        cache = allocate_kv_cache(cloning.num_layers, 32, 16, cloning.num_kv_heads, cloning.head_dim,
                                  torch.float32, torch.device("cpu"))  # fmt: skip
        attn = TorchPagedAttention(cache, cloning.num_qo_heads)
        attn.plan(StepLayout([0, n], [n], pages, pos))
        with torch.inference_mode():
            emb = cloning.embed(ids, Rows(slot, step, prompt_rows=given))
            out.append(cloning.backbone(emb, pos, attn))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    assert int(cloning._audio.sum()) == int((rows[:, 1] >= h.PROMPT_AUDIO).sum()) > 9
