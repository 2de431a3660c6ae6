"""A burst of N prompts starts k a step (`--max-prefills k`): admitted in ceil(N / k) steps, in
arrival order, and each request generates the tokens it generates alone, greedy and sampled, on
Orpheus, CSM and Qwen3-TTS (tiny, CPU). Where streams run, the fitted step cost decides how many
prompts a step takes beside them (at least one), whatever the cap allows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread
from tokenizer_worker.worker import wire_array

TEXTS = ["Hello there.", "A longer sentence, to speak slowly.", "Yes.", "One more, please.", "Fine.",
         "What a day it was.", "No."]  # fmt: skip


@pytest.fixture(scope="module", params=["orpheus-tiny", "csm-tiny", "qwen3-tts-tiny"])
def program(request):
    """float64: on the CPU a GEMM of one row rounds otherwise than that row among others (in float32
    a sampled token can flip); float64 keeps that far below any sampling boundary, so the test sees
    what the engine does with the rows (the GPU's float8 GEMMs give a row the same bits at any
    row count: bench/op_invariance.py)."""
    kw = {"lm_head": "audio"} if request.param == "orpheus-tiny" else {}
    yield from tiny_lm_on_one_thread(request.param, dtype=torch.float64, **kw)


def prompts(program, n: int, extra: int = 12) -> list[Prompt]:
    """n prompts, every other one greedy, the rest sampled with their own seeds."""
    out = []
    for i in range(n):
        built = program.preprocess(TEXTS[i % len(TEXTS)], {})
        rows = np.asarray(getattr(built, "rows", built)).astype("<i4")
        state = {k: wire_array(v) for k, v in getattr(built, "state", {}).items()}
        sp = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_k=50, seed=100 + i)
        if program.can_constrain:
            sp["constrained"] = True
        sampling = SamplingParams(max_tokens=len(rows) + extra, **sp)
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sampling, state=state))
    return out


def limits(**kw) -> GpuWorkerSettings:
    return GpuWorkerSettings(**{"max_batch_size": 8, "max_context": 200, "first_chunk": "reference", **kw})


@pytest.mark.parametrize("n, k", [(7, 3), (5, 5)])
def test_a_burst_of_n_starts_k_a_step_and_each_request_samples_what_it_samples_alone(program, n, k):
    alone = {}
    for p in prompts(program, n):
        eng = Engine(program, limits())
        eng.outputs = {}
        eng.add(p)
        eng.run_until_idle()
        alone |= eng.outputs

    eng = Engine(program, limits(max_prefills=k))
    eng.outputs = {}
    for p in prompts(program, n):
        eng.add(p)
    running, order = [], []
    while eng.waiting:
        eng.step()
        running.append(len(eng.running))
        order += [rid for rid in eng.running if rid not in order]
    steps = math.ceil(n / k)
    assert len(running) == steps and running == [min(n, k * (s + 1)) for s in range(steps)]
    assert order == [f"r{i}" for i in range(n)]  # in arrival order
    eng.run_until_idle()
    assert sorted(eng.outputs) == sorted(alone)
    for rid, (tokens, reason) in alone.items():
        assert eng.outputs[rid][1] == reason
        assert eng.outputs[rid][0] == tokens, rid
    assert eng.allocator.num_used == 0


def test_beside_running_streams_the_step_cost_sets_how_many_prompts_start(program, monkeypatch):
    """Streams running, a fitted cost of 6 ms of decode, 0.5 ms a prompt and 1.5 ms a group of
    prompts run together: the 10.7 ms budget (0.88 of Orpheus' 12.19 ms row) leaves room for two
    prompts a step where each runs in a group of its own (prefill lanes), and for six where they
    join one (the eager runner's one pass; batched prefill graphs), though the cap allows eight;
    where the decode rows alone fill the budget, one prompt a step still starts. (Without lead
    borrow: the budget alone.)"""
    if program.name != "orpheus":  # orpheus-tiny's program
        pytest.skip("the row period of record is Orpheus'")
    eng = Engine(program, limits(max_prefills=8, max_batch_size=16, lead_borrow=False))
    s = eng.scheduler
    s.real_time = True  # paced as on a GPU
    cost = s.clock.cost
    first, rest = prompts(program, 1), prompts(program, 12)[1:]
    eng.add(first[0])
    eng.step()  # one stream running

    def fit(a: float, d: float, e: float) -> None:
        """A step cost of `a` s fixed, `d` s a prompt and `e` s a group, nothing per token or context."""
        cost.__init__()
        rng = np.random.default_rng(0)
        for _ in range(400):
            n = int(rng.integers(0, 4))
            groups = int(rng.integers(min(n, 1), n + 1))
            cost.add(
                int(rng.integers(1, 300)), int(rng.integers(0, 50_000)), n, a + d * n + e * groups, groups
            )

    fit(0.006, 0.0005, 0.0015)
    assert cost.coefficients() == pytest.approx((0.006, 0.0, 0.0, 0.0005, 0.0015), abs=2e-5)  # the ridge
    for p in rest:
        eng.add(p)
    monkeypatch.setattr(eng.runner, "prompt_groups", lambda rows: len(rows))  # a lane each
    eng.step()
    assert len(eng.running) == 3 and s.admitted_last == 2  # (10.7 - 6) / (0.5 + 1.5) ms: two prompts
    monkeypatch.undo()
    eng.step()  # one group: 1.5 ms, then 0.5 ms a prompt
    assert len(eng.running) == 9 and s.admitted_last == 6
    fit(0.011, 0.0005, 0.0015)  # decode alone over the budget: one a step
    eng.step()
    assert s.admitted_last == 1 and len(eng.running) == 10
    # prompts still wait: the next steps may take the whole budget (`StepClock.expect`)
    assert s.clock.rows_time_high(7) >= 7 * 0.88 / program.rows_per_second
