"""Admission from a fitted step cost (gpu_worker.pacing.StepCost): a step's time is recovered as a
fixed part, a part per token, per thousand tokens of context and per prompt, its context part kept
apart from the prompts that come with young streams; the capacity is the load whose step at the
streams' life-average context fits the budget, whatever their age now; and under a closed-loop
overload it holds admission where old streams stay real time (bench/admission_sim.py)."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_worker.pacing as pacing
from bench.admission_sim import GPU, simulate
from gpu_worker.pacing import CAPACITY_HEADROOM, StepClock, StepCost

A, B, C, D = 3e-3, 9e-6, 18e-6, 2e-3  # s, per token, per thousand tokens of context, per prompt
PERIOD = 1 / 82.03


def ramp_steps(n: int, rng: np.random.Generator):
    """A ramp then a steady load: rows grow, each prompt comes with a young stream, contexts age;
    sit-out varies the rows step to step. → rows of (tokens, context, prompt tokens, prompts)."""
    out = []
    for i in range(n):
        streams = min(400, 1 + i // 4)
        prompts = int(rng.random() < (0.5 if streams < 400 else 0.3))
        rows = streams - int(rng.integers(0, 40)) if streams > 100 else streams
        age = min(1024.0, 40 + 0.25 * i / 2)  # contexts grow as the streams age
        context = int(rows * (40 + age * rng.uniform(0.4, 0.6)))
        out.append((rows + 40 * prompts, context, 40 * prompts, prompts))
    return out


def time_of(tokens: int, context: int, prompt_tokens: int, prompts: int) -> float:
    return A + B * tokens + C * context / 1000 + D * prompts


def test_the_fit_recovers_each_part_of_a_steps_time():
    rng = np.random.default_rng(0)
    cost = StepCost()
    for x in ramp_steps(3000, rng):
        cost.add(*x, time_of(*x) * (1 + 0.05 * rng.standard_normal()))
    a, b, c, d = cost.coefficients()
    assert a == pytest.approx(A, rel=0.1)
    assert b == pytest.approx(B, rel=0.1)
    assert c == pytest.approx(C, rel=0.15)  # the context's part, though prompts come with young streams
    assert d == pytest.approx(D, rel=0.15)


def test_a_part_the_steps_do_not_show_is_zero_never_negative():
    rng = np.random.default_rng(1)
    cost = StepCost()
    for x in ramp_steps(3000, rng):
        cost.add(*x, (A + B * x[0]) * (1 + 0.02 * rng.standard_normal()))  # context costs nothing here
    a, b, c, d = cost.coefficients()
    assert min(a, b, c, d) >= 0.0
    assert c < 0.05 * C and d < 0.05 * D
    assert b == pytest.approx(B, rel=0.05)


def test_no_fit_before_enough_steps():
    cost = StepCost()
    for _ in range(pacing.COST_MIN_STEPS - 1):
        cost.add(300, 150_000, 0, 0, 0.01)
    assert cost.coefficients() is None
    assert StepClock(82.03, 512).capacity(life_context=500.0) == 512  # max_batch until measured


def fitted_clock(age: float) -> StepClock:
    """A clock whose steps served 300 streams of `age` tokens of context each, no prompts."""
    clock = StepClock(82.03, 512)
    rng = np.random.default_rng(2)
    for _ in range(1000):
        rows = int(rng.integers(260, 340))
        ctx = int(rows * age * rng.uniform(0.8, 1.2))
        x = (rows, ctx, 0, 0)
        clock.record(rows, time_of(*x), streams=300, cost=x)
    return clock


def test_the_capacity_is_the_load_whose_step_at_the_life_context_fits_the_budget():
    life = 552.0
    expected = (CAPACITY_HEADROOM * PERIOD - A) / (B + C * life / 1000)
    for age in (150.0, 500.0, 900.0):  # young streams, or old: the same capacity
        assert fitted_clock(age).capacity(life_context=life) == pytest.approx(expected, rel=0.03)
    # streams that live longer attend over more: fewer of them fit
    assert fitted_clock(500.0).capacity(life_context=900.0) < 0.8 * expected


def test_an_interval_is_paired_with_the_step_launched_two_before(monkeypatch):
    """The engine launches step k, then waits for step k-1: the interval up to the next tick is
    step k-1's time. Rows that alternate step to step tell the pairing apart."""
    now = [100.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    clock = StepClock(82.03, 512)
    steps = [(300 if k % 3 else 100, 150_000 if k % 2 else 30_000, 0, 0) for k in range(600)]
    for k, x in enumerate(steps):
        if k >= 2:
            now[0] += time_of(*steps[k - 2])  # the time of the step launched two ticks before
        clock.tick(x[0], x[0], x)
    a, b, c, _ = clock.cost.coefficients()
    assert (a, b, c) == pytest.approx((A, B, C), rel=1e-6)


# A GPU a quarter of the H200's size (fitted constants scaled): ~115 streams keep real time at their
# life-average context, fewer when all are old together.
SMALL = GPU(fixed_ms=3.0, row_us=36.0, row_us_per_1k_ctx=72.0, prompt_ms=2.0)


def test_a_closed_loop_overload_waits_at_admission_and_every_stream_admitted_stays_real_time():
    held = simulate(140, gpu=SMALL, duration_s=40.0, life=True)
    assert held["on_time_share"] == 1.0 and held["worst_late_ms"] == 0.0
    assert held["admitted_max"] <= 120  # the rest waited
    # The pace alone admitted young streams that were late once old (the trap this guards against).
    paced = simulate(140, gpu=SMALL, duration_s=40.0, life=False)
    assert paced["admitted_max"] > held["admitted_max"] and paced["on_time_share"] < 0.9


def test_a_load_within_capacity_never_waits():
    r = simulate(100, gpu=SMALL, duration_s=20.0)
    assert r["on_time_share"] == 1.0 and r["wait_p99_ms"] < 20.0


def test_the_engine_reports_its_streams_life_context_from_what_ended_requests_generated():
    from common.messages import Prompt, SamplingParams
    from gpu_worker.engine import Engine, EngineLimits
    from programs import get_spec, load_program_class

    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_lm()
    eng = Engine(program, EngineLimits(max_batch_size=8, max_context=400))
    rows = np.array([128259, 128000, 40, 41, 128009, 128260, 128261, 128257], dtype="<i4")

    def add(rid: str, max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, constrained=True, seed=1)
        eng.add(Prompt(rid, rows.tobytes(), len(rows), sp))

    assert eng.life_context() is None and "life_context" in eng.metrics()
    for i in range(3):
        add(f"a{i}", 60)
    eng.step()
    budget = next(iter(eng.running.values())).gen_budget
    assert eng.life_context() == pytest.approx(len(rows) + budget / 2)  # nothing ended yet: budgets
    eng.run_until_idle()
    assert eng.gen_rows == pytest.approx(budget)  # each generated its whole budget
    add("b", 300)
    eng.step()
    assert eng.life_context() == pytest.approx(len(rows) + budget / 2)  # what requests generate
    assert eng.metrics()["life_context"] == pytest.approx(len(rows) + budget / 2, abs=0.1)


def test_numpy_gauges_reach_the_gateway_as_numbers(tmp_path):
    """The capacity comes out of numpy: msgspec encodes no numpy scalar, and a heartbeat that does
    not encode left the gateway thinking the gpu_worker dead (seen on the H200)."""
    from common.ipc import Addresses, PullChannel
    from common.messages import ProcStatus
    from common.proc import StatusReporter

    addrs = Addresses.local(str(tmp_path / "run"))
    inbox: PullChannel = PullChannel(addrs.gateway_in, ProcStatus, bind=True)
    reporter = StatusReporter(addrs.gateway_in, "gpu_worker", "gpu_worker")
    try:
        reporter.set_load(3, 8, {"stream_capacity": np.float64(412.5), "steps_total": np.int64(7)})
        got = None
        for _ in range(50):
            msg = inbox.recv(timeout_ms=200)
            if msg is not None and msg.metrics:
                got = msg.metrics
                break
        assert got == {"stream_capacity": 412.5, "steps_total": 7.0}
        assert (
            StepClock(82.03, 512).capacity() == 512
            and type(fitted_clock(500.0).capacity(life_context=552.0)) is float
        )
    finally:
        reporter.close()
        inbox.close()
