"""Qwen3-TTS Base (voice cloning) equals the reference (qwen-tts-compat) for the same random weights
(qwen3-tts-base-tiny, CPU fp32), from the same reference clips:

- the encoders: each clip's speaker vector equals the reference's `extract_speaker_embedding`
  within 1e-4 and its codes the 12 Hz encoder's (transformers' `MimiModel.encode`, the class the
  reference's encoder is, its first 16 codebooks cut to ceil(samples / 1920) frames), clips of
  different lengths encoded in one batch;
- the cloned prompt: its embeddings, and every frame's text column, equal what the reference's
  `generate` builds from `voice_clone_prompt` and `ref_ids` (as `generate_voice_clone` passes
  them), in ICL mode (text track longer and shorter than the clip) and x-vector-only mode, with
  streaming and non-streaming text;
- greedy frames equal the reference's, alone and in a batch of staggered requests with different
  voices and modes, through the gpu_worker engine with the speaker vector and the clip's frames as
  per-request state; sampled frames do not depend on the batch;
- the audio: served through the engine and the codec (whose stream the clip's frames prime), it
  equals `generate_voice_clone`'s within 1e-4 (the clip and the frames decoded as one, the clip's
  samples cut off), alone, batched, and in a codec slot another request used.
Bad voices and states are refused with reasons. Skips where the reference is missing.
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import pytest
import torch
from transformers import MimiConfig, MimiModel

from codec_worker.codec import Codec
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import Reference, Rows, Voice
from programs.csm.codec import random_codebooks
from programs.qwen3_tts import spec as q
from programs.qwen3_tts.model import Qwen3TtsLM
from tests.qwen3_tts_reference import reference_module
from tokenizer_worker.worker import wire_array

SPEC = get_spec("qwen3-tts-base-tiny")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs")
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loud(module: torch.nn.Module, seed: int) -> None:
    """Random weights whose every layer counts (fan-in scaled; norms and scales around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5)


@pytest.fixture(scope="module")
def ref():
    mod = reference_module()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    with open(os.path.join(CONFIGS, SPEC["lm_config"])) as f:
        config = json.load(f)
    torch.manual_seed(0)
    model = mod.Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.talker.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    _loud(model.speaker_encoder, 1)
    return model


@pytest.fixture(scope="module")
def mimi():
    """The 12 Hz tokenizer's encoder as the reference runs it: a transformers MimiModel."""
    with open(os.path.join(CONFIGS, SPEC["codec_config"])) as f:
        cfg = dict(json.load(f)["encoder_config"])
    cfg["frame_rate"] = cfg.pop("_frame_rate")
    torch.manual_seed(2)
    model = MimiModel(MimiConfig(**cfg)).eval()
    _loud(model, 3)
    random_codebooks(model)
    return model


@pytest.fixture(scope="module")
def program(ref, mimi):
    p = load_program_class(SPEC["name"])(SPEC, load_format="dummy")
    lm = Qwen3TtsLM(p.read_config("lm_config"))
    lm._check_complete(lm.load_weights(("talker." + k, v) for k, v in ref.talker.state_dict().items()))
    p.lm = lm.eval()
    p.head_weight = lm.codec_head.weight[p.head_ids]
    p.load_prompts()
    p.load_encoders()
    enc = p._encoders
    assert len(enc.speaker.load_weights(ref.state_dict().items())) == len(list(enc.speaker.parameters()))
    enc.codes.load_weights(mimi.state_dict().items())
    return p


def _clip(n: int, seed: int) -> np.ndarray:
    t = np.arange(n) / 24000
    g = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * (120 + 40 * seed) * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return np.clip(tone + 0.1 * g.standard_normal(n), -1, 1).astype(np.float32)


CLIPS = {  # name → (samples, transcript)
    "short": (5000, "Yes."),  # 3 frames: the text track outruns the clip
    "long": (45000, "Well, that was a very long day."),  # 24 frames: the clip outruns the text
    "mid": (20000, "It is raining today."),
}


@pytest.fixture(scope="module")
def voices(program) -> dict[str, Voice]:
    names = list(CLIPS)
    feats = program.encode_references([Reference(_clip(n, i), t) for i, (n, t) in enumerate(CLIPS.values())])
    return {name: Voice(f, CLIPS[name][1]) for name, f in zip(names, feats, strict=True)}


def test_encoders_equal_the_reference(program, ref, mimi, voices):
    for i, (name, (n, _)) in enumerate(CLIPS.items()):
        clip = _clip(n, i)
        want_spk = ref.extract_speaker_embedding(clip, 24000)
        got = voices[name].features
        assert got["speaker"].dtype == np.float32 and got["codes"].dtype == np.int32
        err = np.abs(got["speaker"] - want_spk.numpy()).max()
        assert err < TOL, f"{name}: speaker vector off by {err:.2e}"
        with torch.no_grad():
            codes = mimi.encode(torch.from_numpy(clip)[None, None]).audio_codes[0, :16, : -(-n // 1920)].T
        np.testing.assert_array_equal(got["codes"], codes.numpy(), err_msg=name)
    assert not np.allclose(voices["short"].features["speaker"], voices["long"].features["speaker"])


def _ids(program, text: str, tail: int) -> list[int]:
    """The reference wrapper's tokenized `<|im_start|>assistant\\n{text}<|im_end|>\\n` (+ the next
    assistant role when `tail`)."""
    nl = program.text_ids("\n")
    ids = [q.IM_START_ID, q.ASSISTANT_ID, *nl, *program.text_ids(text), q.IM_END_ID, *nl]
    return ids + ([q.IM_START_ID, q.ASSISTANT_ID, *nl] if tail else [])


def _ref_call(ref, program, text: str, voice: Voice, opts: dict, **kw):
    """`generate` with the arguments `generate_voice_clone` gives it."""
    xvec = opts.get("x_vector_only_mode") == "true"
    prompt = {
        "ref_code": [None if xvec else torch.from_numpy(voice.features["codes"]).long()],
        "ref_spk_embedding": [torch.from_numpy(voice.features["speaker"])],
        "x_vector_only_mode": [xvec],
        "icl_mode": [not xvec],
    }
    return ref.generate(
        input_ids=[torch.tensor([_ids(program, text, 1)])],
        ref_ids=[None if xvec else torch.tensor([_ids(program, voice.text, 0)])],
        voice_clone_prompt=prompt,
        languages=[opts.get("language", "auto")],
        non_streaming_mode=opts.get("non_streaming_mode") == "true",
        **kw,
    )


CASES = {  # rid → (text, voice, options, frames)
    "icl-stream-short": ("The sun was low over the harbor.", "short", {}, 7),
    "icl-stream-long": ("Hi!", "long", {"language": "english"}, 6),
    "icl-whole": ("Thank you so much.", "mid", {"non_streaming_mode": "true"}, 8),
    "xvec-stream": ("I think we should call them first.", "mid", {"x_vector_only_mode": "true"}, 6),
    "xvec-whole": (
        "Well, honestly.",
        "short",
        {"x_vector_only_mode": "true", "non_streaming_mode": "true"},
        7,
    ),
}


class _Captured(Exception):
    pass


@pytest.mark.parametrize("rid", list(CASES))
def test_cloned_prompt_embeddings_equal_the_reference(program, ref, voices, rid, monkeypatch):
    text, voice, opts, _ = CASES[rid]
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        raise _Captured

    monkeypatch.setattr(ref.talker, "generate", capture)
    with pytest.raises(_Captured), torch.no_grad():
        _ref_call(ref, program, text, voices[voice], opts)
    want = seen["inputs_embeds"][0]  # [R, H]
    trailing = seen["trailing_text_hidden"][0]  # [K, H] the text column of frames 0..K-1
    built = program.preprocess(text, opts, voices[voice])
    program.init_state(3)
    program.admit(1, built.state)
    r = len(built.rows)
    assert r == len(want)
    with torch.no_grad():
        got = program.embed(
            torch.from_numpy(built.rows).long(), Rows(torch.ones(r, dtype=torch.long), torch.arange(-r, 0))
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        k = len(trailing) + 2
        frames = torch.randint(0, q.CODE_VOCAB, (k, q.N_CODEBOOKS))
        column = program.embed(frames, Rows(torch.ones(k, dtype=torch.long), torch.arange(k)))
        column = column - program.lm.frame_rows(frames)
        pad = seen["tts_pad_embed"][0, 0]
        wanted = torch.cat([trailing, pad.expand(2, -1)])
        torch.testing.assert_close(column, wanted, atol=1e-5, rtol=0)


def _prompt(program, rid: str, new: int, voices, **sp) -> Prompt:
    text, voice, opts, _ = CASES[rid]
    built = program.preprocess(text, opts, voices[voice])
    rows = np.asarray(built.rows, dtype="<i4")
    state = {k: wire_array(v) for k, v in built.state.items()}
    sampling = SamplingParams(max_tokens=len(rows) + new, min_tokens=q.MIN_FRAMES, **sp)
    return Prompt(rid, rows.tobytes(), len(rows), sampling, state=state)


def _run(program, prompts: list[Prompt], stagger: bool = False) -> dict:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:
            for _ in range(i + 1):
                eng.step()
    eng.run_until_idle()
    assert eng.allocator.num_used == 0
    return eng.outputs


@pytest.fixture(scope="module")
def wanted(ref, program, voices) -> dict:
    out = {}
    for rid, (text, voice, opts, new) in CASES.items():
        with torch.no_grad():
            codes, _ = _ref_call(
                ref,
                program,
                text,
                voices[voice],
                opts,
                max_new_tokens=new + 1,
                do_sample=False,
                subtalker_dosample=False,
            )
        out[rid] = codes[0].numpy()
    return out


def test_greedy_frames_equal_the_reference_alone_and_in_a_batch(program, voices, wanted):
    sp = dict(temperature=0.0, repetition_penalty=1.05)
    prompts = [_prompt(program, rid, new, voices, **sp) for rid, (_, _, _, new) in CASES.items()]
    for rid, want in wanted.items():
        assert len(want) >= 2, f"{rid}: the reference generates frames for these weights"
    alone = _run(program, [prompts[0]])
    np.testing.assert_array_equal(np.array(alone[prompts[0].rid][0]), wanted[prompts[0].rid])
    batched = _run(program, prompts[:4], stagger=True)
    batched.update(_run(program, prompts[4:]))
    for rid, want in wanted.items():
        np.testing.assert_array_equal(np.array(batched[rid][0]), want, err_msg=f"{rid} in a batch")


def test_the_clip_and_the_speaker_change_the_frames(wanted, ref, program, voices):
    """A wrong speaker vector or wrong clip frames would not pass unseen: each changes the frames."""
    text, voice, opts, new = CASES["icl-whole"]
    kw = dict(max_new_tokens=new + 1, do_sample=False, subtalker_dosample=False)
    other = Voice(dict(voices[voice].features), voices[voice].text)
    other.features["speaker"] = -voices[voice].features["speaker"]
    with torch.no_grad():
        swapped, _ = _ref_call(ref, program, text, other, opts, **kw)
    assert not np.array_equal(swapped[0].numpy(), wanted["icl-whole"])
    other = Voice(dict(voices[voice].features), voices[voice].text)
    other.features["codes"] = (voices[voice].features["codes"] + 1) % q.CODE_VOCAB
    with torch.no_grad():
        shifted, _ = _ref_call(ref, program, text, other, opts, **kw)
    assert not np.array_equal(shifted[0].numpy(), wanted["icl-whole"])


def test_sampled_frames_do_not_depend_on_the_batch(program, voices):
    sp = dict(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=5)
    alone = _run(program, [_prompt(program, "icl-stream-short", 8, voices, **sp)])
    others = [
        _prompt(program, r, 6, voices, temperature=1.0, seed=i)
        for i, r in enumerate(["icl-whole", "xvec-stream"])
    ]
    crowd = _run(
        program, [others[0], _prompt(program, "icl-stream-short", 8, voices, **sp), others[1]], stagger=True
    )
    assert alone["icl-stream-short"] == crowd["icl-stream-short"]
    assert len(np.unique(np.array(alone["icl-stream-short"][0])[:, 1:])) > 20


def test_bad_voices_and_states_are_refused(program, voices):
    with pytest.raises(ValueError, match="clones a voice"):
        program.preprocess("Hello.", {})
    with pytest.raises(ValueError, match="ref_text"):
        program.preprocess("Hello.", {}, Voice(voices["mid"].features, ""))
    assert program.preprocess("Hello.", {"x_vector_only_mode": "true"}, Voice(voices["mid"].features, ""))
    with pytest.raises(ValueError, match="x_vector_only_mode"):
        program.preprocess("Hello.", {"x_vector_only_mode": "maybe"}, voices["mid"])
    with pytest.raises(ValueError, match="instructions"):
        program.preprocess("Hello.", {"instructions": "Whisper."}, voices["mid"])
    too_long = dict(voices["mid"].features, codes=np.zeros((SPEC["max_ref_frames"] + 1, 16), np.int32))
    with pytest.raises(ValueError, match="at most"):
        program.preprocess("Hello.", {}, Voice(too_long, "Hi."))
    with pytest.raises(ValueError, match="speaker vector"):
        program.preprocess("Hello.", {}, Voice({"codes": voices["mid"].features["codes"]}, "Hi."))
    custom = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    with pytest.raises(ValueError, match="no reference audio"):
        custom.preprocess("Hello.", {}, voices["mid"])
    built = program.preprocess("Hello there.", {}, voices["mid"])
    assert program.check_prompt(built.rows, built.state) == ""
    bad = {
        "speaker": {**built.state, "speaker": np.zeros(3, np.float32)},
        "codes": {**built.state, "codes": np.full((4, 16), q.CODE_VOCAB, np.int32)},
        "needs": {k: v for k, v in built.state.items() if k != "speaker"},
        "past": {**built.state, "codes": built.state["codes"][:1]},
        "other": {**built.state, "voice": np.zeros(1, np.int32)},
    }
    for name, state in bad.items():
        assert program.check_prompt(built.rows, state), name


@pytest.fixture(scope="module")
def cloner(ref, program):
    """The reference's `generate_voice_clone` whose codec has the program's codec weights (random,
    random codebooks), and that codec loaded in the program."""
    from programs.qwen3_tts.codec import Qwen3TtsCodec
    from tests.qwen3_tts_reference import TextIdsProcessor, reference_speech_tokenizer, voice_clone_wrapper

    path = os.path.join(CONFIGS, SPEC["codec_config"])
    program.codec = Qwen3TtsCodec.from_config(path, torch.float32, "cpu")
    speech = reference_speech_tokenizer(path, program.codec.state_dict())
    processor = TextIdsProcessor(program.text_ids, q.IM_START_ID, q.ASSISTANT_ID, q.IM_END_ID)
    return voice_clone_wrapper(ref, speech, processor)


def _cloned(cloner, voices, rid: str) -> np.ndarray:
    """`generate_voice_clone`'s audio for case `rid`, greedy: [S] float32."""
    wrapper, item = cloner
    text, voice, opts, new = CASES[rid]
    v, xvec = voices[voice], opts.get("x_vector_only_mode") == "true"
    prompt = item(
        ref_code=None if xvec else torch.from_numpy(v.features["codes"]).long(),
        ref_spk_embedding=torch.from_numpy(v.features["speaker"]),
        x_vector_only_mode=xvec,
        icl_mode=not xvec,
        ref_text=None if xvec else v.text,
    )
    wavs, rate = wrapper.generate_voice_clone(
        text,
        language=opts.get("language", "auto"),
        voice_clone_prompt=[prompt],
        non_streaming_mode=opts.get("non_streaming_mode") == "true",
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=new + 1,
    )
    assert rate == 24000
    return wavs[0]


def _serve(
    program, prompts: list[Prompt], codec: Codec, stagger: bool = False, primed: bool = True
) -> dict[str, np.ndarray]:
    """The prompts through the engine and `codec` (several requests' windows in each decode, in
    arrival order), as the workers pass them (`primed` False: the chunks' prefixes left out):
    → each request's PCM16."""
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    batches = []
    for i, p in enumerate(prompts):
        eng.add(p)
        for _ in range(i + 1 if stagger else 0):
            batches.append(eng.step())
    batches += eng.run_until_idle()
    chunks = [c for b in batches if b is not None for c in b.chunks]
    assert [c.index for c in chunks if c.prefix] == [0] * sum(
        p.state.get("codes") is not None for p in prompts
    )
    if not primed:
        chunks = [msgspec.structs.replace(c, prefix=b"") for c in chunks]
    audio: dict[str, list[np.ndarray]] = {}
    for lo in range(0, len(chunks), 5):
        for a in codec.decode(chunks[lo : lo + 5]):
            audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
    ends = codec.ended([f for b in batches if b is not None for f in b.finished])
    assert {f.rid for f in ends} == {p.rid for p in prompts} and not any(f.message for f in ends)
    return {rid: np.concatenate(pcm) for rid, pcm in audio.items()}


def _off(pcm: np.ndarray, want: np.ndarray) -> float:
    assert len(pcm) == len(want) and len(want) % q.SAMPLES_PER_FRAME == 0
    return float(np.abs(pcm / 32767.0 - want).max())


AUDIO_CASES = ["icl-stream-short", "icl-stream-long", "icl-whole", "xvec-stream"]
GREEDY = dict(temperature=0.0, repetition_penalty=1.05)


def test_served_cloned_audio_equals_generate_voice_clone_alone_and_batched(program, voices, cloner):
    """`generate_voice_clone` decodes an in-context clone's clip frames and its generated ones as
    one utterance and cuts the clip's audio off: served through the engine and the codec, whose
    stream the clip's frames prime (`codec_prefix`, sent with chunk 0), the audio equals it within
    1e-4, alone and among staggered requests of other voices and modes; x-vector-only requests
    decode their frames alone, as the reference does. Without the priming the audio differs."""
    wanted = {rid: _cloned(cloner, voices, rid) for rid in AUDIO_CASES}
    prompts = {rid: _prompt(program, rid, CASES[rid][3], voices, **GREEDY) for rid in AUDIO_CASES}
    alone = _serve(program, [prompts["icl-stream-long"]], Codec(program, graphs=False, streams=4))
    err = _off(alone["icl-stream-long"], wanted["icl-stream-long"])
    assert err < TOL, f"alone: off by {err:.2e}"
    batched = _serve(program, list(prompts.values()), Codec(program, graphs=False, streams=4), stagger=True)
    for rid, want in wanted.items():
        err = _off(batched[rid], want)
        assert err < TOL, f"{rid} in a batch: off by {err:.2e}"
    fresh = _serve(program, list(prompts.values()), Codec(program, graphs=False, streams=4), True, False)
    for rid in AUDIO_CASES[:3]:
        assert _off(fresh[rid], wanted[rid]) > 100 * TOL, f"{rid}: the clip's frames change the audio"


def test_a_primed_slot_serves_the_next_request_clean(program, voices, cloner):
    """One codec slot serves an in-context clone (primed), then an x-vector-only one (fresh), then
    another in-context clone: each request's audio is its own reference's."""
    codec = Codec(program, graphs=False, streams=1)
    for rid in ["icl-stream-long", "xvec-stream", "icl-stream-short"]:
        got = _serve(program, [_prompt(program, rid, CASES[rid][3], voices, **GREEDY)], codec)[rid]
        err = _off(got, _cloned(cloner, voices, rid))
        assert err < TOL, f"{rid} after another request in its slot: off by {err:.2e}"
