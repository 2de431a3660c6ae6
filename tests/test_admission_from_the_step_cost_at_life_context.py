"""Admission from a fitted step cost (gpu_worker.scheduler.step_cost.StepCost): a step's time is recovered as a
fixed part, a part per token, per thousand tokens of context and per prompt, its context part kept
apart from the prompts that come with young streams; the capacity is the load whose step at the
streams' life-average context fits the budget, whatever their age now; and under a closed-loop
overload it holds admission where old streams stay real time (bench/admission_sim.py)."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_worker.scheduler.pacing as pacing
import gpu_worker.scheduler.step_cost as step_cost
from bench.admission_sim import GPU, H200, simulate, startup_differences
from common.config import GpuWorkerSettings
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.step_cost import Lives, StepCost

A, B, C, D = 3e-3, 9e-6, 18e-6, 2e-3  # s, per token, per thousand tokens of context, per prompt
PERIOD = 1 / 82.03
CAPACITY_HEADROOM = GpuWorkerSettings().capacity_headroom


def ramp_steps(n: int, rng: np.random.Generator):
    """A ramp then a steady load: rows grow, each prompt comes with a young stream, contexts age;
    sit-out varies the rows step to step. → rows of (tokens, context, prompts)."""
    out = []
    for i in range(n):
        streams = min(400, 1 + i // 4)
        prompts = int(rng.random() < (0.5 if streams < 400 else 0.3))
        rows = streams - int(rng.integers(0, 40)) if streams > 100 else streams
        age = min(1024.0, 40 + 0.25 * i / 2)  # contexts grow as the streams age
        context = int(rows * (40 + age * rng.uniform(0.4, 0.6)))
        out.append((rows + 40 * prompts, context, prompts))
    return out


def time_of(tokens: int, context: int, prompts: int) -> float:
    return A + B * tokens + C * context / 1000 + D * prompts


def test_the_fit_recovers_each_part_of_a_steps_time():
    rng = np.random.default_rng(0)
    cost = StepCost()
    for x in ramp_steps(3000, rng):
        cost.add(*x, time_of(*x) * (1 + 0.05 * rng.standard_normal()))
    a, b, c, d, e = cost.coefficients()
    assert a == pytest.approx(A, rel=0.1)
    assert b == pytest.approx(B, rel=0.1)
    assert c == pytest.approx(C, rel=0.15)  # the context's part, though prompts come with young streams
    assert d + e == pytest.approx(D, rel=0.15)  # each prompt a group of its own: only the sum shows


def test_a_part_the_steps_do_not_show_is_zero_never_negative():
    rng = np.random.default_rng(1)
    cost = StepCost()
    for x in ramp_steps(3000, rng):
        cost.add(*x, (A + B * x[0]) * (1 + 0.02 * rng.standard_normal()))  # context costs nothing here
    a, b, c, d, e = cost.coefficients()
    assert min(a, b, c, d, e) >= 0.0
    assert c < 0.05 * C and d + e < 0.05 * D
    assert b == pytest.approx(B, rel=0.05)


def curved_gpu_s(tokens: int, context: int, prompts: int) -> float:
    """A step whose rows cost compute only past 128 of them (the GEMMs read the weights anyway), as
    on the H200: not linear in its rows."""
    return (
        3.0 + 2e-3 * tokens + 12e-3 * max(0, tokens - 128) + 12e-3 * context / 1000 + 1.6 * prompts
    ) / 1000


def first_ramp(cost: StepCost, rng: np.random.Generator) -> None:
    """bench/ttfa_http's single-stream requests, then 400 streams started over 800 steps, each at
    its prompt's 40 tokens of context plus its age."""
    for _ in range(3000):
        cost.add(1, 100, 0, curved_gpu_s(1, 100, 0) * (1 + 0.03 * rng.standard_normal()))
    ages: list[int] = []
    for step in range(800):
        new = (step + 1) // 2 - len(ages)
        ages += [0] * new
        x = (len(ages) - new + 40 * new, sum(40 + a for a in ages), new)
        cost.add(*x, curved_gpu_s(*x) * (1 + 0.03 * rng.standard_normal()))
        ages = [a + 1 for a in ages]


def test_startup_differences_keep_a_first_ramps_curve_out_of_the_context_part():
    """At a fresh server's first ramp the fit alone charges the rows' curve to the context (as on
    the H200: 30 us per thousand tokens instead of ~11) and the capacity falls short of what the
    GPU holds; the differences the engine measures at startup keep the parts apart."""
    lives = Lives(context=577.0, prompt_tokens=40.0, rows=1050.0)
    budget = CAPACITY_HEADROOM * PERIOD
    per_stream = 2e-6 + 12e-6 + 12e-6 * lives.context / 1000 + (1.6e-3 + 14e-6 * 40) / lives.rows
    truth = (budget - 3e-3 + 128 * 12e-6) / per_stream  # the load whose step takes the budget
    b1, b2, short, long, prompt = 512, 256, 128, 1024, 48
    diffs = [
        ((0, b * (long - short) / 1000, 0), curved_gpu_s(b, b * long, 0) - curved_gpu_s(b, b * short, 0))
        for b in (b1, b2)
    ] + [
        ((b1 - b2, (b1 - b2) * ctx / 1000, 0), curved_gpu_s(b1, b1 * ctx, 0) - curved_gpu_s(b2, b2 * ctx, 0))
        for ctx in (short, long)
    ]
    diffs.append(((prompt, 0, 1), curved_gpu_s(b2 + prompt, b2 * 512, 1) - curved_gpu_s(b2, b2 * 512, 0)))
    alone, calibrated = StepCost(), StepCost()
    calibrated.calibrate(diffs)
    first_ramp(alone, np.random.default_rng(0))
    first_ramp(calibrated, np.random.default_rng(0))
    assert alone.coefficients()[2] > 2 * 12e-6  # the curve taken for context
    assert alone.capacity(budget, lives) < 0.9 * truth
    assert calibrated.coefficients()[2] == pytest.approx(12e-6, rel=0.25)
    assert calibrated.capacity(budget, lives) == pytest.approx(truth, rel=0.05)


def test_the_simulation_measures_its_gpus_parts_at_startup_as_the_engine_does():
    diffs = startup_differences(H200)
    context = [(x, dt) for x, dt in diffs if x[0] == 0 and x[2] == 0]
    prompts = [(x, dt) for x, dt in diffs if x[2] >= 1]  # one, then one and three more (a lane each)
    assert len(context) == 2 and [x[2:] for x, _ in prompts] == [(1, 1), (1, 1), (3, 3)]
    for (_, kcontext, *_), dt in context:
        assert dt == pytest.approx(H200.row_us_per_1k_ctx * kcontext / 1e6)
    for x, dt in prompts:
        assert dt == pytest.approx(x[2] * H200.prompt_ms / 1000)  # its prompts cost no rows
    with_them = simulate(400, gpu=H200, calibrate=True, duration_s=6.0)
    assert with_them["cost_fit"][2] == pytest.approx(H200.row_us_per_1k_ctx, rel=0.2)


def test_no_fit_before_enough_steps():
    clock = StepClock(82.03, 512)
    lives = Lives(500.0, 40.0, 1000.0)
    for _ in range(step_cost.COST_MIN_STEPS - 1):
        clock.record(300, 0.01, streams=300, cost=(300, 150_000, 0))
    assert clock.cost.coefficients() is None
    assert clock.capacity(lives=lives) == clock.capacity()  # the per-size model and the pace
    clock.record(300, 0.01, streams=300, cost=(300, 150_000, 0))
    assert clock.cost.coefficients() is not None


def fitted_clock(age: float, served: int = 300) -> StepClock:
    """A clock whose steps served about `served` streams of `age` tokens of context each, a prompt of
    40 tokens in every third step or so."""
    clock = StepClock(82.03, 512)
    rng = np.random.default_rng(2)
    for _ in range(1000):
        rows = int(rng.integers(served - 40, served + 40))
        prompts = int(rng.random() < 0.3)
        x = (rows + 40 * prompts, int(rows * age * rng.uniform(0.5, 1.5)), prompts)
        clock.record(rows + prompts, time_of(*x), streams=served, cost=x)
    return clock


def test_the_capacity_is_the_load_whose_step_at_the_life_context_fits_the_budget():
    lives = Lives(context=552.0, prompt_tokens=40.0, rows=1024.0)
    # each stream: its rows at its life-average context, and a prompt every 1024 of its rows
    per_stream = B + C * lives.context / 1000 + (D + B * lives.prompt_tokens) / lives.rows
    expected = (CAPACITY_HEADROOM * PERIOD - A) / per_stream
    for age in (150.0, 500.0, 900.0):  # young streams, or old: the same capacity
        # steps of up to 440 rows: the capacity within them, no margin for reaching past them
        assert fitted_clock(age, served=400).capacity(lives=lives) == pytest.approx(expected, rel=0.03)
    # streams that live longer attend over more: fewer of them fit
    assert fitted_clock(500.0).capacity(lives=Lives(900.0, 40.0, 1700.0)) < 0.8 * expected
    # shorter requests bring more prompts: fewer fit
    assert fitted_clock(500.0).capacity(lives=Lives(552.0, 40.0, 100.0)) < 0.9 * expected


def test_a_fit_at_a_light_load_admits_no_further_than_a_probe_beyond_it():
    light, lives = fitted_clock(300.0, served=60), Lives(552.0, 40.0, 1024.0)
    assert light.cost.capacity(CAPACITY_HEADROOM * PERIOD, lives) > 300  # what the fit alone says
    assert light.capacity(lives=lives) < 150  # 64 beyond the ~70 streams a step lately


def test_a_steady_load_keeps_the_fit_the_ramp_made():
    """A steady load does not tell a fixed part from a part per token: without a hold on the earlier
    fit, the fit drifted between them and the capacity with it."""
    rng = np.random.default_rng(3)
    cost = StepCost()
    for x in ramp_steps(2000, rng):
        cost.add(*x, time_of(*x) * (1 + 0.02 * rng.standard_normal()))
    lives = Lives(552.0, 40.0, 1024.0)
    budget = CAPACITY_HEADROOM * PERIOD
    truth = (budget - A) / (B + C * lives.context / 1000 + (D + B * lives.prompt_tokens) / lives.rows)
    seen = []
    for _ in range(30_000):  # five minutes of 400 streams, ~300 tokens of context each
        x = (400 + int(rng.integers(-2, 3)), 120_000 + int(rng.integers(-2000, 2000)), 0)
        cost.add(*x, time_of(*x) * (1 + 0.02 * rng.standard_normal()))
        if cost.n % 1000 == 0:
            seen.append(cost.capacity(budget, lives))
    assert min(seen) > 0.97 * truth and max(seen) < 1.03 * truth
    a, b, c, *_ = cost.coefficients()
    assert a == pytest.approx(A, rel=0.15) and b == pytest.approx(B, rel=0.15)


def test_an_interval_is_paired_with_the_step_launched_two_before(monkeypatch):
    """The engine launches step k, then waits for step k-1: the interval up to the next tick is
    step k-1's time. Rows that alternate step to step tell the pairing apart; after the engine was
    idle the first two intervals pair with nothing from before it."""
    now = [100.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(step_cost, "RIDGE", 0.0)  # exact least squares: one interval paired wrong shows
    clock = StepClock(82.03, 512)
    steps = [(300 if k % 3 else 100, 150_000 if k % 2 else 30_000, 0) for k in range(900)]
    for k, x in enumerate(steps):
        if k == 450:  # idle: then a step is launched with none in flight
            clock.tick(0)
            now[0] += 5.0
        elif k == 451:
            now[0] += 0.0002  # only the host's work: nothing was running to wait for
        elif k >= 2:
            now[0] += time_of(*steps[k - 2])  # the time of the step launched two ticks before
        clock.tick(x[0], x[0], x)
    a, b, c, *_ = clock.cost.coefficients()
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


def test_the_engine_reports_its_streams_lives_from_what_ended_requests_generated():
    from common.config import GpuWorkerSettings
    from common.messages import Prompt, SamplingParams
    from gpu_worker.engine import Engine
    from programs import get_spec, load_program_class

    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_lm()
    eng = Engine(program, GpuWorkerSettings(max_batch_size=8, max_context=400))
    rows = np.array([128259, 128000, 40, 41, 128009, 128260, 128261, 128257], dtype="<i4")

    def add(rid: str, max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, constrained=True, seed=1)
        eng.add(Prompt(rid, rows.tobytes(), len(rows), sp))

    assert eng.lives() is None and "life_context" in eng.metrics()
    for i in range(3):
        add(f"a{i}", 60)
    add("aborted", 300)
    eng.step()
    short = eng.running["a0"].gen_budget
    long = eng.running["aborted"].gen_budget
    lives = eng.lives()  # nothing ended yet: the budgets
    assert lives.context == pytest.approx(len(rows) + (3 * short + long) / 8)
    assert lives.rows == pytest.approx((3 * short + long) / 4) and lives.prompt_tokens == len(rows)
    for _ in range(5):
        eng.step()
    eng.abort("aborted")  # an abort says nothing of what requests generate
    eng.run_until_idle()
    assert (
        eng.scheduler.n_ended == 3
        and eng.scheduler.gen_rows == pytest.approx(short)
        and eng.scheduler.gen_rows2 == pytest.approx(short**2)
    )
    idle = eng.lives()  # idle: the last prompts and what requests generated
    assert idle == pytest.approx(Lives(len(rows) + short / 2, len(rows), short))
    add("b", 300)
    eng.step()
    lives = eng.lives()  # what requests generate, within each one's budget
    assert lives.context == pytest.approx(len(rows) + short / 2) and lives.rows == pytest.approx(short)
    assert eng.metrics()["life_context"] == pytest.approx(len(rows) + short / 2, abs=0.1)
    # a long request holds its slot longer: a slot's context averages E[n^2] / (2 E[n]) past the prompt
    eng.scheduler.gen_rows, eng.scheduler.gen_rows2 = 100.0, 100.0**2 + 60.0**2  # lengths 100 +- 60
    assert eng.lives().context == pytest.approx(len(rows) + (100.0**2 + 60.0**2) / 200.0)


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
        reporter.set_load(3, 8, {"stream_capacity": np.float64(412.5), "steps_total": np.int64(7), "x": "no"})
        got = None
        for _ in range(50):
            msg = inbox.recv(timeout_ms=200)
            if msg is not None and msg.metrics:
                got = msg.metrics
                break
        assert got == {"stream_capacity": 412.5, "steps_total": 7.0}
        assert (
            StepClock(82.03, 512).capacity() == 512
            and type(fitted_clock(500.0).capacity(lives=Lives(552.0, 40.0, 1024.0))) is float
        )
    finally:
        reporter.close()
        inbox.close()
