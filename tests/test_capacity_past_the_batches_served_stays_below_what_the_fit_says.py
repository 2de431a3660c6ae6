"""The capacity a worker reports where its step-cost fit extrapolates (`StepClock.capacity`): past the
rows measured (the largest batch the fit holds once the steps after it measured it), a margin that
grows with the doublings beyond; at the load served, each step as much slower than the fit as the
latest steps are (`StepClock.slowness`).

On a GPU whose whole steps cost more per row than its startup steps say (they time the forward pass
alone) and whose rows cost more past a knee, a fit over steps of up to 256 rows says far more streams
keep real time than do (on the H200: 483 where ~430 keep it, and a burst of 448 is admitted whole).
With the margin the capacity stays at or below what the GPU keeps; once steps near it are served, it
comes to it from what they measure."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import gpu_worker.scheduler.step_cost as step_cost
from bench.admission_sim import GPU, H200, H200_FORWARD, simulate, startup_differences
from gpu_worker.scheduler.pacing import PACE_STEPS, SLOW_MIN_STEPS, StepClock
from gpu_worker.scheduler.step_cost import COST_STEPS, Lives, StepCost

SERVED = dataclasses.replace(H200, fixed_ms=3.4)  # the fixed part the H200's burst runs fit
# A GPU a quarter of that (rows 4x the cost, past a knee at 32 rows), and its startup steps the
# forward pass alone: ~120 streams of 512 rows keep real time.
QUARTER = GPU(
    fixed_ms=3.4, row_us=62.0, row_us_per_1k_ctx=44.0, prompt_ms=1.6, knee=32, row_us_below_knee=8.0
)
QUARTER_FORWARD = GPU(fixed_ms=2.28, row_us=24.0, row_us_per_1k_ctx=52.0, prompt_ms=1.6, noise=0.0)
LIVES = Lives(context=552.0, prompt_tokens=40.0, rows=1024.0)


def truth(clock: StepClock, gpu: GPU = SERVED, lives: Lives = LIVES) -> int:
    """The most streams at their life-average context, a prompt every `lives.rows` rows each, whose
    step on `gpu` takes no more than the capacity's budget."""
    budget = clock.capacity_headroom * clock.period
    lo, hi = 1, 512
    while hi - lo > 1:
        n = (lo + hi) // 2
        step = gpu.step_s(np.full(n, lives.context), 0, None) + n / lives.rows * gpu.prompt_ms / 1000
        lo, hi = (n, hi) if step <= budget else (lo, n)
    return lo


def fresh_clock() -> StepClock:
    """A worker's clock after startup: the forward pass alone timed (H200_FORWARD)."""
    clock, steps = StepClock(82.03, 512), {}
    clock.cost.calibrate(startup_differences(H200_FORWARD, steps))
    clock.seed(steps, now=0.0)
    return clock


def serve(clock: StepClock, rng: np.random.Generator, rows: tuple[int, int], steps: int) -> None:
    """`steps` steps on SERVED of `rows` (low, high) decode rows of any age and 0-2 prompts each."""
    for _ in range(steps):
        n, prompts = int(rng.integers(rows[0], rows[1] + 1)), int(rng.integers(0, 3))
        ctx = rng.uniform(40, 1064, n)
        cost = (n + 40 * prompts, int(ctx.sum()), prompts)
        clock.record(n + prompts, SERVED.step_s(ctx, prompts, rng), now=0.0, streams=n, cost=cost)


@pytest.mark.parametrize("margin", [True, False])
def test_past_the_batches_served_the_capacity_stays_below_what_the_gpu_keeps(margin, monkeypatch):
    if not margin:
        monkeypatch.setattr(step_cost, "EXTRAPOLATION", 0.0)
    rng = np.random.default_rng(0)
    clock = fresh_clock()
    keeps = truth(clock)  # ~410
    fresh = clock.capacity(lives=LIVES)
    serve(clock, rng, (200, 256), 1500)  # a load of 200-256 streams
    assert clock.largest_fitted() == 258
    assert clock.slowness() == pytest.approx(1.0, abs=0.02)  # the fit is made of those steps
    after = clock.capacity(lives=LIVES)
    if not margin:  # the fit alone (slower by nothing at the load it is made of): a burst past what
        # the GPU keeps is admitted whole
        assert fresh == 512 and after > 1.15 * keeps
        return
    assert fresh < 0.8 * keeps  # nothing served: no more than PROBE_MIN rows taken as measured
    assert 0.9 * keeps <= after <= keeps
    # Steps near the capacity, slower than the fit made of smaller ones says: until the steps after
    # them have measured them, a batch the capacity extrapolates to; then it follows what they cost.
    serve(clock, rng, (380, 400), PACE_STEPS)
    assert clock.largest_fitted() == 258 and clock.slowness() > 1.03
    assert 0.8 * keeps < clock.capacity(lives=LIVES) <= keeps
    serve(clock, rng, (380, 400), PACE_STEPS)
    assert clock.largest_fitted() > 380 and clock.slowness() > 1.02
    assert clock.capacity(lives=LIVES) == pytest.approx(keeps, rel=0.03)


def test_the_margin_grows_with_the_distance_past_the_largest_batch_served():
    cost = StepCost()
    for rows in (100, 200, 300) * 100:
        cost.add(rows, 0, 0, 3e-3 + 20e-6 * rows)  # nothing per context or prompt
    a, per_row, *_ = cost.coefficients()
    assert (a, per_row) == pytest.approx((3e-3, 20e-6), rel=0.01)  # within the fit's ridge
    lives = Lives(context=0.0, prompt_tokens=0.0, rows=1e9)
    budget = 11e-3
    linear = (budget - a) / per_row  # ~400
    assert cost.capacity(budget, lives) == pytest.approx(linear, rel=1e-3)
    assert cost.capacity(budget, lives, seen=450) == pytest.approx(linear, rel=1e-3)  # within: as fitted
    for seen in (100, 200, 300):
        n = cost.capacity(budget, lives, seen=seen)
        margin = 1 + step_cost.EXTRAPOLATION * math.log2(n / seen)
        assert seen < n < linear and (a + per_row * n) * margin == pytest.approx(budget, rel=1e-3)
    assert cost.capacity(budget, lives, seen=100) < cost.capacity(budget, lives, seen=200)
    # every step half again as slow as the fit says: what fits two thirds of the budget
    slow = cost.capacity(budget, lives, slow=1.5)
    assert slow == pytest.approx((budget / 1.5 - a) / per_row, rel=1e-3)
    assert cost.capacity(budget, lives, slow=0.5) == pytest.approx(linear, rel=1e-3)  # never faster


def test_the_largest_batch_is_the_fits_once_measured_and_the_slowness_the_load_served_since_idle():
    rng = np.random.default_rng(1)
    clock = fresh_clock()
    assert clock.largest_fitted() == 0 and clock.slowness() == 1.0  # seeds are not steps served
    serve(clock, rng, (300, 300), 10)
    serve(clock, rng, (100, 120), PACE_STEPS - 10)
    assert clock.largest_fitted() == 0  # no step yet measured by PACE_STEPS after it
    serve(clock, rng, (100, 120), COST_STEPS - PACE_STEPS - 5)
    assert 300 <= clock.largest_fitted() <= 302  # 300 rows and their prompts, among the last COST_STEPS
    serve(clock, rng, (100, 100), 20)
    assert 100 < clock.largest_fitted() <= 122  # the 300-row steps left the fit's window
    serve(clock, rng, (100, 100), SLOW_MIN_STEPS)
    assert clock.slowness() != 1.0
    clock.tick(0)  # idle: the next load's own steps say how it compares with the fit
    assert clock.slowness() == 1.0


@pytest.mark.parametrize("margin", [True, False])
def test_a_burst_past_capacity_after_smaller_levels_admits_what_stays_real_time(margin, monkeypatch):
    """Levels of 16 and 64 clients, then 160 at once, on one worker (as `voxpipe bench ttfa --load`
    runs them): with the margins every admitted stream stays on time and the rest wait; the fit
    alone admits the whole burst and every stream falls behind."""
    if not margin:
        monkeypatch.setattr(step_cost, "EXTRAPOLATION", 0.0)
        monkeypatch.setattr(StepClock, "slowness", lambda self: 1.0)
    kw = dict(gpu=QUARTER, calibrate=True, startup=QUARTER_FORWARD, ramp_s=0.0, duration_s=6.0, tokens=512)
    r = simulate(160, before=(16, 64), **kw)
    keeps = truth(StepClock(82.03, 512), QUARTER, Lives(40 + 256, 40, 512))  # 122
    if margin:
        assert r["on_time_share"] == 1.0 and r["admitted_max"] <= 1.1 * keeps
        assert 0.9 * keeps <= r["capacity_p50"] <= keeps
    else:
        assert r["admitted_max"] == 160 and r["on_time_share"] < 0.5
