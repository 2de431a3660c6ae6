"""Qwen3-TTS through the gpu_worker engine equals the reference's `Qwen3TTSForConditionalGeneration.generate`
(qwen-tts-compat) for the same random weights (qwen3-tts-tiny, CPU fp32), from the prompt the
program builds: greedy frames (talker and code predictor, repetition penalty 1.05, the end id
masked for the first two frames) alone and inside a batch of staggered requests, in both text modes
(the whole text in the prompt; the text entering one token per frame), with a speaker, a language,
a dialect speaker and an instruction; sampled frames that do not depend on the batch; and the
audio the codec_worker streams, frame by frame with state per request and requests interleaved in
its decodes, equal within 1 LSB of PCM16 to the reference decoder's whole-utterance decode of the
same frames (random weights and codebooks)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import pcm16
from programs.qwen3_tts import spec as q
from programs.qwen3_tts.codec import Qwen3TtsCodec
from programs.qwen3_tts.model import Qwen3TtsLM
from tests.qwen3_tts_reference import reference_decoder, reference_module
from tokenizer_worker.worker import wire_array

SPEC = get_spec("qwen3-tts-tiny")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs", SPEC["lm_config"])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def config() -> dict:
    with open(CONFIG) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ref(config):
    mod = reference_module()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    torch.manual_seed(0)
    model = mod.Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**config)).eval()
    with torch.no_grad():  # every talker weight random, norms and biases too
        for name, p in model.talker.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def program(config, ref):
    p = load_program_class("qwen3-tts-tiny")(SPEC, load_format="dummy")
    lm = Qwen3TtsLM(config)
    lm._check_complete(lm.load_weights(("talker." + k, v) for k, v in ref.talker.state_dict().items()))
    p.lm = lm.eval()
    p.head_weight = lm.codec_head.weight[p.head_ids]
    p.load_prompts()
    return p


def ref_generate(ref, program, text: str, new: int, **kw) -> np.ndarray:
    """The reference's frames for `text` (input ids from the program's tokenizer, as the reference
    wrapper's `_build_assistant_text` lays them out)."""
    tok = program._tokenizer
    nl = tok.text_ids("\n")
    ids = [q.IM_START_ID, q.ASSISTANT_ID, *nl, *tok.text_ids(text), q.IM_END_ID, *nl]
    ids += [q.IM_START_ID, q.ASSISTANT_ID, *nl]
    instruct = kw.pop("instructions", None)
    instruct_ids = None
    if instruct:
        instruct_ids = [
            torch.tensor(
                [[q.IM_START_ID, *tok.text_ids("user\n"), *tok.text_ids(instruct), q.IM_END_ID, *nl]]
            )
        ]
    with torch.no_grad():
        codes, _ = ref.generate(
            input_ids=[torch.tensor([ids])],
            instruct_ids=instruct_ids,
            languages=[kw.pop("language", "auto")],
            speakers=[kw.pop("voice", SPEC["default_voice"])],
            # The reference's last talker pass samples a codebook 0 that gets no codebooks 1..15 and
            # is dropped: `new` frames take new + 1 passes.
            max_new_tokens=new + 1,
            do_sample=False,
            subtalker_dosample=False,
            **kw,
        )
    return codes[0].numpy()  # [frames, 16]


def make_prompt(program, rid: str, text: str, new: int, options: dict, **sp) -> Prompt:
    built = program.preprocess(text, options)
    rows = np.asarray(built.rows, dtype="<i4")
    state = {k: wire_array(v) for k, v in built.state.items()}
    sampling = SamplingParams(max_tokens=len(rows) + new, min_tokens=q.MIN_FRAMES, **sp)
    return Prompt(rid, rows.tobytes(), len(rows), sampling, state=state)


def run(program, prompts: list[Prompt], stagger: bool = False) -> Engine:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=300))
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:  # later requests join a batch that is already decoding
            for _ in range(i + 1):
                eng.step()
    eng.batches = eng.run_until_idle()
    assert eng.allocator.num_used == 0, "every KV page is returned"
    return eng


CASES = {
    "a": ("Hello there, how are you today?", {}, 9),
    "b": ("The sun was low over the harbor.", {"voice": "ryan", "language": "english"}, 7),
    "c": ("Thank you so much.", {"voice": "eric", "non_streaming_mode": "false"}, 11),
    "d": ("I think we should call them first.", {"non_streaming_mode": "false", "language": "German"}, 8),
    "e": ("Well, honestly, I don't know.", {"instructions": "Speak slowly and warmly."}, 6),
}


def _ref_kwargs(options: dict) -> dict:
    kw = {k: v for k, v in options.items() if k in ("voice", "language", "instructions")}
    kw["non_streaming_mode"] = options.get("non_streaming_mode", "true") == "true"
    return kw


@pytest.fixture(scope="module")
def wanted(ref, program) -> dict:
    return {
        rid: ref_generate(ref, program, text, new, **_ref_kwargs(opts))
        for rid, (text, opts, new) in CASES.items()
    }


def test_greedy_frames_equal_the_reference_alone_and_in_a_batch(program, wanted):
    for rid, want in wanted.items():
        assert len(want) >= 2, f"{rid}: the reference generates frames for these weights"
    sp = dict(temperature=0.0, repetition_penalty=1.05)
    prompts = [make_prompt(program, rid, t, new, o, **sp) for rid, (t, o, new) in CASES.items()]
    for p in prompts[:2]:
        alone = run(program, [p])
        np.testing.assert_array_equal(
            np.array(alone.outputs[p.rid][0]), wanted[p.rid], err_msg=f"{p.rid} alone"
        )
    batched = run(program, prompts[:4], stagger=True)
    batched.outputs.update(run(program, prompts[4:]).outputs)
    for rid, want in wanted.items():
        frames, reason = batched.outputs[rid]
        np.testing.assert_array_equal(np.array(frames), want, err_msg=f"{rid} in a batch")
        assert reason == (FinishReason.LENGTH if len(want) == CASES[rid][2] else FinishReason.STOP)


def test_the_streaming_text_mode_changes_the_frames(wanted, ref, program):
    text, opts, new = CASES["c"]
    whole = ref_generate(ref, program, text, new, **_ref_kwargs({**opts, "non_streaming_mode": "true"}))
    assert not np.array_equal(whole, wanted["c"]), "the text column matters: the modes differ"


def test_sampled_frames_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=77)
    text, opts, _ = CASES["d"]
    alone = run(program, [make_prompt(program, "x", text, 8, opts, **sp)])
    others = [
        make_prompt(program, r, CASES[r][0], 6, CASES[r][1], temperature=1.0, seed=i)
        for i, r in enumerate("ab")
    ]
    crowd = run(program, [others[0], make_prompt(program, "x", text, 8, opts, **sp), others[1]], stagger=True)
    assert alone.outputs["x"] == crowd.outputs["x"]
    frames = np.array(alone.outputs["x"][0])
    assert len(np.unique(frames[:, 1:])) > 20, "the code predictor samples too"


def test_bad_prompts_are_refused_by_the_program(program):
    built = program.preprocess("Hello.", {"non_streaming_mode": "false"})
    rows = built.rows.copy()
    rows[0, 0] = q.TALKER_VOCAB  # a codec id past the talker's vocabulary
    assert "out of range" in program.check_prompt(rows, built.state)
    assert "text" in program.check_prompt(built.rows, {"text": np.full(3, q.TALKER_VOCAB * 100, np.int32)})
    assert program.check_prompt(built.rows, {"speaker": np.zeros(4, np.float32)})
    assert program.check_prompt(built.rows, built.state) == ""
    with pytest.raises(ValueError, match="voice"):
        program.preprocess("Hello.", {"voice": "nobody"})
    with pytest.raises(ValueError, match="language"):
        program.preprocess("Hello.", {"language": "klingon"})


def test_streamed_audio_equals_the_reference_decode_of_the_whole_utterance(program):
    codec_config = os.path.join(os.path.dirname(CONFIG), SPEC["codec_config"])
    program.codec = Qwen3TtsCodec.from_config(codec_config, torch.float32, "cpu")
    ref = reference_decoder(codec_config)
    ref.load_state_dict(program.codec.state_dict(), strict=True)
    sp = dict(temperature=0.9, top_k=50, repetition_penalty=1.05)
    prompts = [
        make_prompt(program, rid, t, 12 + 3 * i, o, seed=i, **sp)
        for i, (rid, (t, o, _)) in enumerate(CASES.items())
    ]
    eng = run(program, prompts[:3], stagger=True)
    chunks = [c for b in eng.batches for c in b.chunks]
    assert all(len(c.tokens) == 4 * 16 for c in chunks), "a window is one frame"
    codec = Codec(program, graphs=False, streams=4)
    audio: dict[str, list[np.ndarray]] = {}
    for lo in range(0, len(chunks), 5):  # several requests' frames in each decode, in arrival order
        for a in codec.decode(chunks[lo : lo + 5]):
            audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
    assert codec.slots is not None
    for rid in audio:
        frames = torch.tensor(np.array(eng.outputs[rid][0]))  # [T, 16]
        with torch.no_grad():
            want = pcm16(ref.chunked_decode(frames.T[None])[0, 0]).numpy()
        got = np.concatenate(audio[rid])
        assert len(got) == len(want) == 1920 * len(frames)
        assert np.abs(got.astype(np.int32) - want).max() <= 1, rid
