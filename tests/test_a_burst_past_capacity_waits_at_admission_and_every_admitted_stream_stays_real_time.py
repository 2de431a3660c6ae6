"""A burst past capacity (every client at once, more than the GPU keeps real time) on the simulated
GPU of bench/admission_sim.py, with the engine's own clock, step cost and first-chunk promises:
admission takes only streams it can keep real time and every one of them stays on time; the rest
wait at the gateway (which bounds the wait with --queue-timeout and then answers 503 with
Retry-After: tests/test_admission_queues_then_refuses_with_retry_after.py).

Two parts make it so. The steps a worker times at startup (`StepClock.seed`: its largest batches at
a long context) are its first measurements, so a fresh worker reports a capacity its GPU keeps, not
its largest batch, and the fit counts from the first step; and a step starts no more prompts than
the fitted step cost leaves room for beside the running streams (`StepCost.prompt_room`), so the
steps that start a burst do not make the streams already running late."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.admission_sim import GPU, H200, simulate, startup_differences
from gpu_worker.scheduler.pacing import PROBE_MIN, StepClock
from gpu_worker.scheduler.step_cost import EXTRAPOLATION, Lives

# A GPU a quarter of the H200's size whose prompts beyond a step's first cost a prefill pass each
# (the prefill lanes): ~115 streams keep real time at their life-average context.
SMALL = GPU(fixed_ms=3.0, row_us=36.0, row_us_per_1k_ctx=72.0, prompt_ms=1.6, extra_prompt_ms=3.3)
LANES = dataclasses.replace(H200, extra_prompt_ms=3.3)


def test_a_fresh_worker_reports_the_capacity_its_startup_steps_allow_not_its_largest_batch():
    lives = Lives(context=552.0, prompt_tokens=40.0, rows=1024.0)
    fresh = StepClock(82.03, 512)
    assert fresh.capacity(lives=lives) == 512  # nothing measured: its largest batch
    steps: dict = {}
    diffs = startup_differences(SMALL, steps)
    seeded = StepClock(82.03, 512)
    seeded.cost.calibrate(diffs)
    seeded.seed(steps)
    assert sorted(steps) == [(256, 1024), (512, 1024)]
    assert seeded.cost.coefficients() is not None  # the fit counts at once
    budget = seeded.capacity_headroom * seeded.period
    per_stream = (36.0 + 72.0 * 0.552) / 1e6 + (1.6e-3 + 36e-6 * 40) / 1024
    # no step served yet: past PROBE_MIN rows the step is taken to cost EXTRAPOLATION more of
    # itself for each doubling of them (the startup steps time the forward pass alone)
    lo, hi = PROBE_MIN, (budget - 3e-3) / per_stream
    for _ in range(60):
        n = (lo + hi) / 2
        over = (3e-3 + per_stream * n) * (1 + EXTRAPOLATION * math.log2(n / PROBE_MIN)) > budget
        lo, hi = (lo, n) if over else (n, hi)
    assert hi < 0.9 * (budget - 3e-3) / per_stream
    assert seeded.capacity(lives=lives) == pytest.approx(hi, rel=0.05)


def test_a_burst_past_capacity_admits_what_stays_real_time_and_the_rest_wait():
    held = simulate(140, gpu=SMALL, ramp_s=0.0, duration_s=30.0, calibrate=True)
    assert held["on_time_share"] == 1.0 and held["worst_late_ms"] == 0.0
    assert held["admitted_max"] <= 120  # of 140: the rest waited at the gateway
    # Without the startup steps a fresh worker claims its largest batch: all 140 start, a third late.
    blind = simulate(140, gpu=SMALL, ramp_s=0.0, duration_s=30.0, calibrate=False)
    assert blind["admitted_max"] == 140 and blind["on_time_share"] < 0.8


def test_the_steps_that_start_a_burst_leave_the_running_streams_real_time():
    """384 at once on an H200 whose prompts beyond a step's first take a lane's pass each: four a
    step (the lanes) make the first streams late; as many as the step cost leaves room for, none."""
    roomy = simulate(384, gpu=LANES, ramp_s=0.0, duration_s=12.0, calibrate=True)
    assert roomy["on_time_share"] >= 0.99 and roomy["worst_late_ms"] <= 2.0
    lanes = simulate(384, gpu=LANES, ramp_s=0.0, duration_s=12.0, calibrate=True, room=False)
    assert lanes["on_time_share"] < 0.95 and lanes["worst_late_ms"] > 20.0
