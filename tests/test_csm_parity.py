"""CSM through the gpu_worker engine equals transformers' CsmForConditionalGeneration for the same
random weights (csm-tiny, CPU fp32): greedy frames (backbone and depth decoder) alone and inside a
batch of staggered requests, a prompt with a context turn carrying audio, the all-zero stop frame;
and the audio the codec_worker streams (one frame a window, decoded once with state per request,
requests interleaved) equals `generate(output_audio=True)`'s whole decode."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import CsmConfig, CsmForConditionalGeneration

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import DetokChunk, FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import pcm16
from programs.csm.codec import MimiCodec, random_codebooks
from programs.csm.model import CsmLM
from programs.csm.spec import TEXT_MARK

SPEC = get_spec("csm-tiny")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "csm", "configs")
AUDIO, AUDIO_EOS = 128002, 128003  # the processor's <|AUDIO|> and <|audio_eos|>


def _config(name: str) -> dict:
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    cfg = CsmConfig(**_config(SPEC["lm_config"]), codec_config=_config(SPEC["codec_config"]))
    model = CsmForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        random_codebooks(model.codec_model)  # else every code decodes alike (zero codebooks)
    return model


@pytest.fixture(scope="module")
def program(hf):
    p = load_program_class("csm-tiny")(SPEC, load_format="dummy")
    lm = CsmLM(_config(SPEC["lm_config"]))
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("codec_model.")}
    lm._check_complete(lm.load_weights(state.items()))
    p.lm = lm.eval()
    p.codec = MimiCodec(hf.codec_model)
    return p


def text_rows(ids: list[int]) -> list[list[int]]:
    return [[i] + [TEXT_MARK] * 31 for i in ids]


def make_prompt(rid: str, rows: list[list[int]], new: int, **sp) -> Prompt:
    arr = np.asarray(rows, dtype="<i4")
    return Prompt(rid, arr.tobytes(), len(arr), SamplingParams(max_tokens=len(arr) + new, **sp))


def run(program, prompts: list[Prompt], stagger: bool = False) -> Engine:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:  # later requests join a batch that is already decoding
            for _ in range(i + 1):
                eng.step()
    eng.batches = eng.run_until_idle()
    assert eng.allocator.num_used == 0, "every KV page is returned"
    return eng


def hf_generate(hf, ids: list[int], new: int, **audio) -> np.ndarray:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=new, do_sample=False, depth_decoder_do_sample=False, **audio
        )
    return out[0].numpy()  # [new, 32]


TEXTS = {
    "a": [128000, 300, 301, 302, 128001],
    "b": [128000, *range(500, 520), 128001],
    "c": [128000, 7, 128001],
}
NEW = {"a": 9, "b": 6, "c": 12}


def test_greedy_frames_equal_transformers_alone_and_in_a_batch(hf, program):
    want = {rid: hf_generate(hf, ids, NEW[rid]) for rid, ids in TEXTS.items()}
    sp = dict(temperature=0.0)
    prompts = [make_prompt(rid, text_rows(ids), NEW[rid], **sp) for rid, ids in TEXTS.items()]
    alone = run(program, prompts[:1])
    np.testing.assert_array_equal(np.array(alone.outputs["a"][0]), want["a"])
    batched = run(program, prompts, stagger=True)
    for rid in TEXTS:
        frames, reason = batched.outputs[rid]
        assert reason == FinishReason.LENGTH
        np.testing.assert_array_equal(np.array(frames), want[rid], err_msg=f"{rid} in a batch")


def test_context_turn_with_audio_equals_transformers_encoding_it(hf, program):
    wave = torch.randn(1, 1, 9600, generator=torch.Generator().manual_seed(3)) * 0.1  # 0.4 s
    with torch.no_grad():
        codes = hf.codec_model.encode(wave).audio_codes[0].T.tolist()  # [frames, 32] Mimi codes
    turn0, turn1 = [128000, 300, 301, 128001], [128000, 400, 401, 402, 128001]
    ids = turn0 + [AUDIO] * len(codes) + [AUDIO_EOS] + turn1
    # transformers' own merge encodes the audio and places its frames and the end frame; generate()
    # then runs from those embeddings (its input_values path in 5.x drops the audio during prefill).
    with torch.no_grad():
        merged = hf._merge_input_ids_with_input_values(torch.tensor([ids]), wave, torch.tensor([[9600]]))
        want = hf.generate(
            inputs_embeds=merged["inputs_embeds"],
            max_new_tokens=5,
            do_sample=False,
            depth_decoder_do_sample=False,
        )[0].numpy()
    rows = text_rows(turn0) + codes + [[0] * 32] + text_rows(turn1)
    eng = run(program, [make_prompt("ctx", rows, 5, temperature=0.0)])
    np.testing.assert_array_equal(np.array(eng.outputs["ctx"][0]), want)


def test_all_zero_frame_stops_like_transformers(hf, program):
    # Zero heads make every logit 0, so greedy picks code 0 everywhere: the first frame is the end.
    zeroed = CsmForConditionalGeneration(hf.config).eval()
    zeroed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        zeroed.lm_head.weight.zero_()
        zeroed.depth_decoder.codebooks_head.weight.zero_()
    want = hf_generate(zeroed, TEXTS["a"], 8)
    assert want.tolist() == [[0] * 32], "transformers stops after the end frame"
    p = load_program_class("csm-tiny")(SPEC, load_format="dummy")
    p.lm = CsmLM(_config(SPEC["lm_config"]))
    p.lm.load_weights((k, v) for k, v in zeroed.state_dict().items() if not k.startswith("codec_model."))
    eng = run(p, [make_prompt("z", text_rows(TEXTS["a"]), 8, temperature=0.0)])
    assert eng.outputs["z"] == ([], FinishReason.STOP)


def test_sampled_frames_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.9, top_k=50, seed=77)
    alone = run(program, [make_prompt("x", text_rows(TEXTS["b"]), 6, **sp)])
    others = [
        make_prompt(r, text_rows(TEXTS[r]), NEW[r], temperature=1.0, seed=i) for i, r in enumerate("ac")
    ]
    crowd = run(
        program, [others[0], make_prompt("x", text_rows(TEXTS["b"]), 6, **sp), others[1]], stagger=True
    )
    assert alone.outputs["x"] == crowd.outputs["x"]
    frames = np.array(alone.outputs["x"][0])
    assert len(frames) == 6 and len(np.unique(frames[:, 1:])) > 20, "the depth decoder samples too"


def test_streamed_audio_equals_the_whole_mimi_decode(hf, program):
    new = 14
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([TEXTS["c"]]),
            max_new_tokens=new,
            do_sample=False,
            depth_decoder_do_sample=False,
            output_audio=True,
            return_dict_in_generate=True,
        )
    assert (out.sequences[0] < 2048).all(), "greedy frames of these weights are all decodable"
    others = [
        make_prompt(r, text_rows(TEXTS[r]), NEW[r], temperature=0.9, seed=i) for i, r in enumerate("ab")
    ]
    eng = run(program, [others[0], make_prompt("c", text_rows(TEXTS["c"]), new, temperature=0.0), others[1]])
    chunks = [c for b in eng.batches for c in b.chunks]
    assert all(len(c.tokens) == 4 * 32 for c in chunks), "a window is one frame"
    assert [c.index for c in chunks if c.rid == "c"] == list(range(new)), "the first audio needs one frame"
    codec = Codec(program, graphs=False, streams=4)
    audio: dict[str, list[np.ndarray]] = {}
    for lo in range(0, len(chunks), 5):  # several requests' frames in each decode, in arrival order
        for a in codec.decode(chunks[lo : lo + 5]):
            audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
    assert sorted(audio) == ["a", "b", "c"]
    got = np.concatenate(audio["c"])
    want = pcm16(out.audio[0]).numpy()  # transformers: MimiModel.decode of the whole stream
    assert len(got) == len(want) == new * 1920
    assert np.abs(got.astype(np.int32) - want).max() <= 1
    for rid in "ab":  # the sampled requests' streams too (their frames may hold extra ids: as 2047)
        frames = torch.tensor(np.array(eng.outputs[rid][0])).clamp(max=2047)
        want = pcm16(program.codec.decode_all(frames)).numpy()
        got = np.concatenate(audio[rid])
        assert len(got) == len(want) == 1920 * len(frames)
        assert np.abs(got.astype(np.int32) - want).max() <= 1, rid


def test_a_frame_with_an_extra_id_still_sounds(program):
    """Random weights sample the LM's extra ids (2048..2050) now and then; Mimi has no code for
    them. The stream decodes them as code 2047 and keeps the frame's audio, so it has no gap."""
    gen = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 2048, (6, 32), generator=gen)
    odd, last = frames.clone(), frames.clone()
    odd[4, 5], last[4, 5] = 2049, 2047
    chunks = [
        DetokChunk(rid, i, 0, f[i : i + 1].numpy().astype("<i4").tobytes(), i)
        for i in range(len(frames))
        for rid, f in (("odd", odd), ("last", last))
    ]
    audio: dict[str, list[bytes]] = {}
    for a in Codec(program, graphs=False, streams=2).decode(chunks):
        audio.setdefault(a.rid, []).append(a.pcm)
    with_extra, as_2047 = (np.frombuffer(b"".join(audio[rid]), "<i2") for rid in ("odd", "last"))
    assert len(with_extra) == len(as_2047) == 6 * 1920
    assert np.abs(with_extra.astype(np.int32) - as_2047).max() <= 1
