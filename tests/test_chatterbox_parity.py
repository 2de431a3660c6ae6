"""Chatterbox's T3 through the gpu_worker engine equals chatterbox-tts 0.1.7's `T3.inference` for the
same random weights (chatterbox-tiny, CPU fp32), from the voice and text the program's prompt holds:
greedy speech tokens with classifier-free guidance (two KV sequences per request, cond + w·(cond −
uncond) with the request's cfg_weight, the repetition penalty 1.2) alone and inside a batch of
staggered requests with different weights and exaggerations; sampled tokens that do not depend on
the batch; and a voice cloned from a clip (the program's `encode_references`: the voice encoder's
speaker embedding, the S3 tokenizer's prompt tokens) equal to the reference's `prepare_conditionals`
for T3 (the same random encoder weights), its conditioning rows equal, its tokens equal.

The reference always samples (multinomial); with min_p = 1 only the most likely token survives,
which is the greedy choice our temperature 0 makes. The stop row of the speech head is scaled up so
that random weights end most utterances within the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import Reference, Voice
from programs.chatterbox import spec as c
from programs.chatterbox.model import T3LM
from tests.chatterbox_reference import reference_encoders, reference_t3

SPEC = get_spec("chatterbox-tiny")
STOP_SCALE = 2.2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def program():
    p = load_program_class("chatterbox-tiny")(SPEC, load_format="dummy")
    lm = T3LM(p.read_config("lm_config"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # every weight random, norms too
        for name, t in lm.named_parameters():
            norm = name.endswith("norm.weight")
            t.copy_(torch.randn(t.shape, generator=gen) * (0.2 if norm else 0.05) + (1.0 if norm else 0.0))
        lm.speech_head.weight[c.STOP_SPEECH] *= STOP_SCALE
    p.lm = lm.eval()
    p.head_ids = torch.arange(c.SPEECH_VOCAB)
    p.load_prompts()
    return p


@pytest.fixture(scope="module")
def ref(program):
    return reference_t3(program.lm)


def ref_generate(ref, program, text: str, options: dict, new: int, voice=None) -> np.ndarray:
    """The reference's speech tokens (stop excluded) for the voice, options and text of the
    program's prompt."""
    from chatterbox.models.t3.modules.cond_enc import T3Cond

    state = program.preprocess(text, options, voice).state
    rows = program.preprocess(text, options, voice).rows[:, 0]
    n = int(state["text_rows"][0])
    text_ids = torch.tensor(rows[c.COND_ROWS : c.COND_ROWS + n] - c.TEXT, dtype=torch.long)
    cond = T3Cond(
        speaker_emb=torch.from_numpy(state["speaker"])[None],
        cond_prompt_speech_tokens=torch.from_numpy(state["prompt_tokens"]).long()[None],
        emotion_adv=float(state["exaggeration"][0]) * torch.ones(1, 1, 1),
    )
    with torch.inference_mode():
        out = ref.inference(
            t3_cond=cond,
            text_tokens=torch.stack([text_ids, text_ids]),
            max_new_tokens=new,
            temperature=0.8,
            min_p=1.0,
            top_p=1.0,
            repetition_penalty=1.2,
            cfg_weight=float(state["cfg_weight"][0]),
        )[0].numpy()
    return out[:-1] if out[-1] == c.STOP_SPEECH else out


def make_prompt(program, rid: str, text: str, new: int, options: dict, voice=None, **sp) -> Prompt:
    p = program.preprocess(text, options, voice)
    rows = np.asarray(p.rows, dtype="<i4")
    state = {k: np.ascontiguousarray(v) for k, v in p.state.items()}
    return Prompt(
        rid,
        rows.tobytes(),
        len(rows),
        SamplingParams(max_tokens=len(rows) // 2 + new, **sp),
        state={k: wire_array(v) for k, v in state.items()},
    )


def run(program, prompts: list[Prompt], stagger: bool = False) -> Engine:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:  # later requests join a batch that is already decoding
            for _ in range(i + 1):
                eng.step()
    eng.run_until_idle()
    assert eng.allocator.num_used == 0, "every KV page is returned"
    return eng


CASES = {
    "a": ("Hello there, how are you today?", {}),
    "b": ("the sun was low over the harbor", {"cfg_weight": "1.0"}),
    "c": ("Thank you so much.", {"exaggeration": "1.2"}),
    "d": ("I think we should call them first; then we can decide.", {"cfg_weight": "0.3"}),
}
BUDGET = 60


@pytest.fixture(scope="module")
def wanted(ref, program) -> dict:
    return {rid: ref_generate(ref, program, t, o, BUDGET) for rid, (t, o) in CASES.items()}


def test_greedy_tokens_with_guidance_equal_the_reference_alone_and_in_a_batch(program, ref, wanted):
    ended = [rid for rid, w in wanted.items() if len(w) < BUDGET]
    assert len(ended) >= 2, "these weights end most utterances within the budget"
    plain = ref_generate(ref, program, CASES["a"][0], {"cfg_weight": "0"}, BUDGET)
    assert not np.array_equal(plain, wanted["a"]), "guidance changes the tokens"
    prompts = [make_prompt(program, rid, t, BUDGET, o, temperature=0.0) for rid, (t, o) in CASES.items()]
    alone = run(program, prompts[:1])
    np.testing.assert_array_equal(alone.outputs["a"][0], wanted["a"])
    batched = run(program, prompts, stagger=True)
    for rid, want in wanted.items():
        tokens, reason = batched.outputs[rid]
        np.testing.assert_array_equal(tokens, want, err_msg=f"{rid} in a batch")
        assert reason == (FinishReason.STOP if rid in ended else FinishReason.LENGTH), rid


def test_sampled_tokens_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.8, min_p=0.05, repetition_penalty=1.2, seed=77)
    text, opts = CASES["d"]
    alone = run(program, [make_prompt(program, "x", text, 40, opts, **sp)])
    others = [
        make_prompt(program, r, CASES[r][0], 30, CASES[r][1], temperature=1.0, seed=i)
        for i, r in enumerate("ab")
    ]
    crowd = run(
        program, [others[0], make_prompt(program, "x", text, 40, opts, **sp), others[1]], stagger=True
    )
    assert alone.outputs["x"] == crowd.outputs["x"]
    assert len(set(alone.outputs["x"][0])) > 5, "sampled, not a constant"


def test_guidance_combines_each_requests_pair_by_itself(program):
    """`guide` is row-wise: a request's guided logits are cond + w·(cond − uncond) with its slot's
    weight, the same bits in any batch (what a sampled request's rows depend on besides is the
    backbone's GEMMs: docs/models/chatterbox.md)."""
    program.init_state(5)
    program._weight[:4] = torch.tensor([0.5, 0.0, 1.0, 0.3])
    logits = torch.randn(4, 2, 1, c.SPEECH_VOCAB, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([2, 0, 3, 1])
    batch = program.guide(logits, slots)
    for i in range(4):
        assert torch.equal(program.guide(logits[i : i + 1], slots[i : i + 1])[0], batch[i])
    cond, uncond = logits[:, 0].double(), logits[:, 1].double()
    w = torch.tensor([1.0, 0.5, 0.3, 0.0], dtype=torch.float64)[:, None, None]
    torch.testing.assert_close(batch.double(), cond + w * (cond - uncond), atol=1e-6, rtol=0)


def test_bad_prompts_are_refused_by_the_program(program):
    p = program.preprocess("Hello.", {})
    assert program.check_prompt(p.rows, p.state) == ""
    assert "unconditional" in program.check_prompt(p.rows[:-2], p.state)
    bad = p.rows.copy()
    bad[-5, 0] = bad[c.COND_ROWS + 2, 0]  # the unconditional prompt keeps a text embedding
    assert program.check_prompt(bad, p.state)
    assert program.check_prompt(p.rows, {**p.state, "cfg_weight": np.array([5.0], np.float32)})
    assert program.check_prompt(p.rows, {k: v for k, v in p.state.items() if k != "speaker"})
    with pytest.raises(ValueError, match="cfg_weight"):
        program.preprocess("Hello.", {"cfg_weight": "lots"})
    with pytest.raises(ValueError, match="unknown model options"):
        program.preprocess("Hello.", {"emotion": "happy"})
    with pytest.raises(ValueError, match="empty"):
        program.preprocess("  ", {})


def clip(seconds: float, seed: int) -> np.ndarray:
    """A 16 kHz clip: a quarter second of silence, a voiced stretch (harmonics of a gliding pitch
    under a syllable-rate envelope, plus noise), a quarter second of silence."""
    gen = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t) + 10 * gen.standard_normal()
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    voiced = 0.2 * voiced + 0.01 * gen.standard_normal(len(t))
    silence = np.zeros(4000)
    return np.concatenate([silence, voiced, silence]).astype(np.float32)


@pytest.fixture(scope="module")
def encoders(program):
    program.load_encoders()
    return reference_encoders(program._speaker_encoder, program._speech_tokenizer)


def test_clip_features_equal_the_reference_encoders(program, encoders):
    ve, tok = encoders
    clips = [clip(s, i) for i, s in enumerate((0.3, 1.5, 4.0, 8.0))]
    features = program.encode_references([Reference(w) for w in clips])
    for wav, f in zip(clips, features, strict=True):
        want = ve.embeds_from_wavs([wav], sample_rate=16000).mean(0)
        np.testing.assert_allclose(f["speaker"], want, atol=2e-6, rtol=0)
        tokens, _ = tok.forward([wav[:96000]], max_len=150)
        np.testing.assert_array_equal(f["prompt_tokens"], tokens[0].numpy())
    assert [len(f["prompt_tokens"]) for f in features] == [20, 50, 113, 150], "6 s at most, 25 a second"
    assert len(set(features[2]["prompt_tokens"].tolist())) > 20, "the tokens vary"
    assert np.abs(features[1]["speaker"] - features[2]["speaker"]).max() > 1e-3, "clips differ"


def test_a_cloned_voice_speaks_as_the_reference_conditioned_on_the_clip(program, ref, encoders):
    from chatterbox.models.t3.modules.cond_enc import T3Cond

    ve, tok = encoders
    wav = clip(4.0, 9)
    voice = Voice(program.encode_references([Reference(wav)])[0])
    cond = T3Cond(
        speaker_emb=torch.from_numpy(ve.embeds_from_wavs([wav], sample_rate=16000)).mean(0, keepdim=True),
        cond_prompt_speech_tokens=tok.forward([wav[:96000]], max_len=150)[0],
        emotion_adv=0.5 * torch.ones(1, 1, 1),
    )
    with torch.inference_mode():
        want = ref.prepare_conditioning(cond)[0]
        state = program.preprocess("Hello.", {}, voice).state
        got = program.lm.cond_rows(
            torch.from_numpy(state["speaker"]),
            torch.from_numpy(state["prompt_tokens"]).long(),
            torch.from_numpy(state["exaggeration"]),
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    text, opts = CASES["a"]
    tokens = ref_generate(ref, program, text, opts, BUDGET, voice)
    assert not np.array_equal(tokens, ref_generate(ref, program, text, opts, BUDGET)), "the voice matters"
    eng = run(program, [make_prompt(program, "v", text, BUDGET, opts, voice, temperature=0.0)])
    np.testing.assert_array_equal(eng.outputs["v"][0], tokens)
