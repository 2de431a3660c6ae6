"""Higgs Audio v2 through the gpu_worker engine equals transformers' `HiggsAudioV2ForConditionalGeneration.generate`
for the same random weights (higgs-tts-tiny, CPU fp32), from the prompt the program builds: greedy
rows (8 codebooks from one hidden state, the delay pattern's forced stream bos and eos, the stop at
the all-eos row, or at max_tokens, with the published repetition-aware sampling, its redraws the
runtime's: tests/higgs_tts_reference.py `repetition_aware`) alone and inside a batch of staggered
requests; sampled rows that do not depend on
the batch; and the audio the codec_worker streams, one row at a time with state per request and
requests interleaved in its decodes, equal within 1 LSB of PCM16 to the reference tokenizer's
whole-utterance decode (`HiggsAudioV2Processor.batch_decode`'s steps: between the bos and eos rows,
the delay pattern reverted, codes clipped) of the same rows (random weights and codebooks).

The eos rows of the audio head are scaled up (x1.3) so that random weights end their utterances
within a few dozen rows, through each way the reference stops: an eos sampled in some codebook
starts the countdown, others sampled during it, the all-eos row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import pcm16
from programs.higgs_tts import spec as h
from programs.higgs_tts.codec import HiggsCodec
from programs.higgs_tts.model import HiggsLM
from tests.higgs_tts_reference import reference_lm, reference_tokenizer, repetition_aware

SPEC = get_spec("higgs-tts-tiny")
EOS_SCALE = 1.3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def program():
    p = load_program_class("higgs-tts-tiny")(SPEC, load_format="dummy")
    lm = HiggsLM(p.read_config("lm_config"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every weight random, norms too
        for name, t in lm.named_parameters():
            scale = 0.2 if name.endswith("norm.weight") else 0.05
            t.copy_(
                torch.randn(t.shape, generator=gen) * scale + (1.0 if name.endswith("norm.weight") else 0.0)
            )
        lm.audio_lm_head.weight.view(h.N_CODEBOOKS, h.CODEBOOK_IDS, -1)[:, h.STREAM_EOS] *= EOS_SCALE
    p.lm = lm.eval()
    p.load_prompts()
    return p


@pytest.fixture(scope="module")
def ref(program):
    return reference_lm(program.lm)


def ref_generate(ref, program, text: str, options: dict, new: int) -> np.ndarray:
    """The reference's rows [T, 8] for the program's prompt of `text` (its ids as input_ids)."""
    ids = torch.tensor(program.preprocess(text, options).rows[:, 0][None].astype(np.int64))
    with torch.no_grad(), repetition_aware(ref, [0]) as ras:  # the requests' seed: 0
        out = ref.generate(input_ids=ids, max_new_tokens=new, do_sample=False)[0].numpy()
    REDRAWS.append(ras["redraws"])
    return out


REDRAWS: list[int] = []  # the reference's repetition-aware redraws per generate


def as_reference(rows: np.ndarray) -> np.ndarray:
    """Our rows with the program's marker values read as the stream eos (spec.py)."""
    return np.where(rows >= h.STREAM_EOS, h.STREAM_EOS, rows)


def make_prompt(program, rid: str, text: str, new: int, options: dict, **sp) -> Prompt:
    rows = np.asarray(program.preprocess(text, options).rows, dtype="<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=len(rows) + new, **sp))


def run(program, prompts: list[Prompt], stagger: bool = False) -> Engine:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    eng.outputs = {}
    batches = []
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:  # later requests join a batch that is already decoding
            for _ in range(i + 1):
                batches.append(eng.step())
    eng.batches = [b for b in batches if b is not None] + eng.run_until_idle()
    assert eng.allocator.num_used == 0, "every KV page is returned"
    return eng


CASES = {
    "a": ("Hello there, how are you today?", {}),
    "b": ("The sun was low over the harbor.", {"scene": "SPEAKER0: feminine, warm"}),
    "c": ("Thank you so much.", {"system": "Generate audio."}),
    "d": ("I think we should call them first, and then we can decide.", {}),
    "e": ("Well, honestly, I don't know.", {"scene": "A large hall."}),
}
BUDGET = 80  # rows a request may generate (the flush rows included)


CUT = 25  # rows of request "f", case b's text cut by max_tokens before its end


@pytest.fixture(scope="module")
def wanted(ref, program) -> dict:
    rows = {rid: ref_generate(ref, program, t, o, BUDGET) for rid, (t, o) in CASES.items()}
    return {**rows, "f": ref_generate(ref, program, *CASES["b"], CUT)}


def test_greedy_rows_equal_the_reference_alone_and_in_a_batch(program, wanted):
    assert sum(REDRAWS) >= 1, "repetition-aware sampling redraws in these rows (2 with these weights)"
    ended = [rid for rid, want in wanted.items() if (want[-1] == h.STREAM_EOS).all()]
    assert len(ended) >= 3 and "f" not in ended, "these weights end most utterances within the budget"
    assert len({len(w) for w in wanted.values()}) >= 3, "of different lengths"
    flush = program.flush_rows
    sp = dict(temperature=0.0)
    prompts = [make_prompt(program, rid, t, BUDGET + flush, o, **sp) for rid, (t, o) in CASES.items()]
    for p in prompts[:2]:
        alone = run(program, [p])
        rows = np.array(alone.outputs[p.rid][0])
        np.testing.assert_array_equal(as_reference(rows[: len(wanted[p.rid])]), wanted[p.rid], err_msg=p.rid)
    cut = make_prompt(program, "f", *CASES["b"][:1], CUT, CASES["b"][1], **sp)
    batched = run(program, prompts[:4], stagger=True)
    batched.outputs.update(run(program, [*prompts[4:], cut]).outputs)
    for rid, want in wanted.items():
        rows, reason = batched.outputs[rid]
        rows = np.array(rows)
        np.testing.assert_array_equal(as_reference(rows[: len(want)]), want, err_msg=f"{rid} in a batch")
        if rid in ended:  # the all-eos row, then flush rows, then the stop
            assert reason == FinishReason.STOP and len(rows) == len(want) + flush - 1, rid
            np.testing.assert_array_equal(rows[len(want) :, 0], h.FLUSH_BASE + np.arange(1, flush))
        else:
            assert reason == FinishReason.LENGTH, rid


def test_sampled_rows_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.9, top_k=50, top_p=0.95, seed=77)
    text, opts = CASES["d"]
    alone = run(program, [make_prompt(program, "x", text, 30, opts, **sp)])
    others = [
        make_prompt(program, r, CASES[r][0], 20, CASES[r][1], temperature=1.0, seed=i)
        for i, r in enumerate("ab")
    ]
    crowd = run(
        program, [others[0], make_prompt(program, "x", text, 30, opts, **sp), others[1]], stagger=True
    )
    assert alone.outputs["x"] == crowd.outputs["x"]
    rows = np.array(alone.outputs["x"][0])
    assert len(np.unique(rows[8:, 1:])) > 20, "codebooks 1..7 are sampled too"


def test_bad_prompts_are_refused_by_the_program(program):
    rows = program.preprocess("Hello.", {}).rows
    assert program.check_prompt(rows, {}) == ""
    assert "audio_out_bos" in program.check_prompt(rows[:-1], {})
    bad = rows.copy()
    bad[3, 2] = 5
    assert "column 0" in program.check_prompt(bad, {})
    assert program.check_prompt(rows, {"speaker": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="preset voices"):
        program.preprocess("Hello.", {"voice": "nobody"})
    with pytest.raises(ValueError, match="model options"):
        program.preprocess("Hello.", {"voice": "", "emotion": "happy"})
    with pytest.raises(ValueError, match="empty"):
        program.preprocess("  ", {})


def test_streamed_audio_equals_the_reference_decode_of_the_whole_utterance(program, ref):
    codec_config = program.config_path("codec_config")
    program.codec = HiggsCodec.from_config(codec_config, torch.float32, "cpu")
    tokenizer = reference_tokenizer(program.codec, codec_config)
    flush = program.flush_rows
    prompts = [
        make_prompt(program, rid, t, BUDGET + flush, o, temperature=0.0) for rid, (t, o) in CASES.items()
    ]
    eng = run(program, prompts[:4], stagger=True)
    chunks = [c for b in eng.batches for c in b.chunks]
    assert all(len(c.tokens) == 4 * h.N_CODEBOOKS for c in chunks), "a window is one row"
    codec = Codec(program, graphs=False, streams=5)
    audio: dict[str, list[np.ndarray]] = {}
    for lo in range(0, len(chunks), 5):  # several requests' rows in each decode, in arrival order
        for a in codec.decode(chunks[lo : lo + 5]):
            audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
    ended = 0
    for rid in audio:
        rows, reason = eng.outputs[rid]
        rows = as_reference(np.array(rows))
        end = [i for i, r in enumerate(rows) if (r == h.STREAM_EOS).all()]
        if not end:
            continue  # cut by max_tokens: its last frames' look-ahead never came
        ended += 1
        # HiggsAudioV2Processor.batch_decode: rows after the last all-bos row up to the first
        # all-eos row, the delay pattern reverted, codes clipped into the codebook
        start = max(i for i, r in enumerate(rows) if (r == h.STREAM_BOS).all())
        body = torch.tensor(rows[start + 1 : end[0]])
        n = len(body) - h.N_CODEBOOKS + 1
        frames = torch.stack([body[k : k + n, k] for k in range(h.N_CODEBOOKS)], dim=1).clip(0, h.CODES - 1)
        with torch.no_grad():
            want = pcm16(tokenizer.decode(frames.T[None], return_dict=False)[0, 0]).numpy()
        got = np.concatenate(audio[rid])
        assert len(got) == len(want) == h.SAMPLES_PER_FRAME * n, rid
        assert np.abs(got.astype(np.int32) - want).max() <= 1, rid
    assert ended >= 2, "utterances that end, decoded whole"
