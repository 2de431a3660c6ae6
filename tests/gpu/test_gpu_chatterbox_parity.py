"""Chatterbox's T3 on the GPU (dummy 520M weights, bf16), classifier-free guidance through the
engine (two KV sequences per request, FlashInfer's eager attention):

1. Greedy and sampled tokens of a request alone equal its tokens among 3 and 11 others that join
   at different steps with other guidance weights and exaggerations (batch invariance of the pair),
   with float8 backbone weights; with bf16 ones among 3 (among 11 reported).
2. The eager engine's first guided logits equal the reference T3's (chatterbox-tts 0.1.7, the same
   weights in bf16) over the same prompt within bf16's tolerance.
3. Decode step time per batch size (reported): each step holds 2 sequences per stream.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.chatterbox import spec as c

MODEL = "chatterbox"
TEXTS = [
    "Hello there, how are you today?",
    "The sun was low over the harbor when the boats came back.",
    "Thank you so much for coming.",
    "I think we should call them first, and then we can decide.",
]


@pytest.fixture(scope="module")
def program():
    p = load_program_class(MODEL)(get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16)
    p.load_lm()
    p.load_prompts()
    return p


def options(i: int) -> dict[str, str]:
    return {"cfg_weight": str(0.3 + 0.1 * (i % 5)), "exaggeration": str(0.4 + 0.2 * (i % 3))}


def prompt(program, rid: str, i: int, new: int, **sp) -> Prompt:
    p = program.preprocess(TEXTS[i % len(TEXTS)], options(i))
    rows = np.asarray(p.rows, dtype="<i4")
    state = {k: wire_array(v) for k, v in p.state.items()}
    return Prompt(
        rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=len(rows) // 2 + new, **sp), state=state
    )


def run(program, prompts: list[Prompt], stagger: bool) -> dict:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=16, max_context=600))
    eng.outputs = {}
    for i, p in enumerate(prompts):
        eng.add(p)
        if stagger:
            for _ in range(i % 3 + 1):
                eng.step()
    eng.run_until_idle()
    return eng.outputs


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=0.8, min_p=0.05, seed=11)])
def test_tokens_alone_equal_tokens_in_a_batch(program, sp, gpu_report):
    """bf16 weights: equal among 3 others (8 rows a step); among 11 (24 rows) reported only, since a
    bf16 GEMM rounds a row by the step's row count (docs/performance.md, "Batch invariance"; the
    fp8 test below asserts both)."""
    target = prompt(program, "x", 3, 120, repetition_penalty=1.2, **sp)
    alone = run(program, [target], False)["x"]
    sizes = {}
    for n in (3, 11):
        others = [prompt(program, f"o{i}", i, 100, temperature=0.8, seed=i) for i in range(n)]
        crowd = run(program, [*others[:1], target, *others[1:]], True)["x"]
        first = next((i for i, (a, b) in enumerate(zip(crowd[0], alone[0], strict=False)) if a != b), None)
        sizes[n] = {"tokens": len(crowd[0]), "equal": crowd == alone, "first_difference": first}
    gpu_report("chatterbox_batch_invariance").setdefault("sampling", {})[str(sp)] = sizes
    assert sizes[3]["equal"], sizes


def test_first_guided_logits_equal_the_reference(program, gpu_report):
    from tests.chatterbox_reference import reference_t3

    ref = reference_t3(program.lm).to(device="cuda", dtype=torch.bfloat16)
    p = program.preprocess(TEXTS[0], options(0))
    w = float(p.state["cfg_weight"][0])
    n = int(p.state["text_rows"][0])
    from chatterbox.models.t3.modules.cond_enc import T3Cond

    text = torch.tensor(p.rows[c.COND_ROWS : c.COND_ROWS + n, 0] - c.TEXT, device="cuda").long()
    cond = T3Cond(
        speaker_emb=torch.from_numpy(p.state["speaker"])[None],
        cond_prompt_speech_tokens=torch.from_numpy(p.state["prompt_tokens"]).long()[None],
        emotion_adv=float(p.state["exaggeration"][0]) * torch.ones(1, 1, 1),
    ).to(device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        embeds, _ = ref.prepare_input_embeds(
            t3_cond=cond,
            text_tokens=torch.stack([text, text]),
            speech_tokens=torch.full((2, 1), c.START_SPEECH, device="cuda"),
            cfg_weight=w,
        )
        bos = ref.speech_emb(
            torch.full((2, 1), c.START_SPEECH, device="cuda")
        ) + ref.speech_pos_emb.get_fixed_embedding(0)
        hidden = ref.tfmr(inputs_embeds=torch.cat([embeds, bos], 1)).last_hidden_state[:, -1]
        logits = ref.speech_head(hidden).float()
        want = logits[0] + w * (logits[0] - logits[1])
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=600))
    req = prompt(program, "x", 0, 10, temperature=0.0, repetition_penalty=1.0)
    eng.outputs = {}
    eng.add(req)
    eng.run_until_idle()
    first = eng.outputs["x"][0][0]
    gap = (want.max() - want[first]).item()
    gpu_report("chatterbox_reference_logits").update(
        {"first_token": int(first), "ref_argmax": int(want.argmax()), "gap": gap}
    )
    assert gap <= 0.02 * want.abs().max().item(), "our first token is the reference's argmax within bf16"


def test_decode_step_time(program, gpu_report):
    times = {}
    for b in (1, 8, 32, 64):
        eng = Engine(program, GpuWorkerSettings(max_batch_size=b, max_context=600))
        for i in range(b):
            eng.add(prompt(program, f"r{i}", i, 200, temperature=0.8, seed=i))
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 20
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        times[b] = 1000 * (time.perf_counter() - t0) / steps
        eng.run_until_idle()
    gpu_report("chatterbox_decode_step_ms").update({str(b): ms for b, ms in times.items()})
    assert times[1] < 40.0, "one stream's step fits in a token (40 ms)"


@pytest.fixture(scope="module")
def program_fp8():
    p = load_program_class(MODEL)(
        get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16, quantization="fp8"
    )
    p.load_lm()
    p.load_prompts()
    return p


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=0.8, min_p=0.05, seed=11)])
def test_fp8_tokens_alone_equal_tokens_in_a_batch(program_fp8, sp, gpu_report):
    """With float8 backbone weights (`--quantization fp8`) a request's tokens do not depend on its
    batch: float8 GEMMs give a row the same bits at any row count."""
    target = prompt(program_fp8, "x", 3, 120, repetition_penalty=1.2, min_tokens=60, **sp)
    alone = run(program_fp8, [target], False)["x"]
    sizes = {}
    for n in (3, 11):
        others = [prompt(program_fp8, f"o{i}", i, 100, temperature=0.8, seed=i) for i in range(n)]
        crowd = run(program_fp8, [*others[:1], target, *others[1:]], True)["x"]
        first = next((i for i, (a, b) in enumerate(zip(crowd[0], alone[0], strict=False)) if a != b), None)
        if first is None and len(crowd[0]) != len(alone[0]):
            first = min(len(crowd[0]), len(alone[0]))  # one ends earlier
        sizes[n] = {"tokens": len(crowd[0]), "first_difference": first}
    gpu_report("chatterbox_batch_invariance_fp8").setdefault("sampling", {})[str(sp)] = sizes
    assert all(v["first_difference"] is None for v in sizes.values()) and len(alone[0]) >= 60, sizes
