"""`--trust-startup-steps`: a fresh worker's capacity from the largest batches its startup steps
timed, counted as measured rows, each step taken up to STARTUP_SLOWNESS times the forward pass
they timed (less as the steps served come to STARTUP_NEAR of that batch) while that batch is
larger than any the steps served measured; off, the capacity past the load
served carries the fit's extrapolation margin from PROBE_MIN rows on (a fresh H200 reports ~195
streams at first, ~370-380 once served)."""

from __future__ import annotations

import pytest

from bench.admission_sim import H200_FORWARD, H200_RATE, ROWS_PER_S, simulate, startup_differences
from common.options import parse_role
from gpu_worker.scheduler.pacing import PACE_STEPS, PROBE_MIN, STARTUP_NEAR, STARTUP_SLOWNESS, StepClock
from gpu_worker.scheduler.step_cost import COST_STEPS, Lives

LIVES = Lives(context=40 + 512, prompt_tokens=40, rows=1024)  # a burst's requests of 1024 rows


def fresh(trust: bool) -> StepClock:
    """A worker's clock after its startup steps on the simulated H200's forward pass."""
    clock = StepClock(ROWS_PER_S, 512, trust_startup=trust)
    steps: dict = {}
    clock.cost.calibrate(startup_differences(H200_FORWARD, steps))
    clock.seed(steps, now=0.0)
    return clock


def test_a_fresh_worker_counts_its_startup_batches_as_measured_and_assumes_the_steps_slower():
    trusted, plain = fresh(True), fresh(False)
    assert plain.measured_rows() == 0.0 and plain.slowness() == 1.0
    assert trusted.measured_rows() == 512.0 and trusted.slowness() == 1.0  # its other uses: as measured
    budget = trusted.capacity_headroom * trusted.period
    expect = trusted.cost.capacity(budget, LIVES, 512.0, STARTUP_SLOWNESS)
    assert trusted.capacity(lives=LIVES) == pytest.approx(min(512.0, expect))
    assert plain.capacity(lives=LIVES) == pytest.approx(plain.cost.capacity(budget, LIVES, PROBE_MIN, 1.0))
    # on the H200's forward pass the trusted capacity takes a burst of 384 at once, the other not
    assert plain.capacity(lives=LIVES) < 300 < 384 < trusted.capacity(lives=LIVES)


def serve(clock: StepClock, steps: int, slow: float, rows: int = 256, ctx: int = 300) -> None:
    """`steps` decode steps of `rows` streams, each `slow` times what the fit says of it."""
    cost = (rows, rows * ctx, 0, 0)
    for i in range(steps):
        clock.record(rows, slow * clock.cost.predict(*cost), now=float(i), streams=rows, cost=cost)


def assumed(rows: float) -> float:
    """The slowness the capacity assumes beside the startup batch of 512 rows where the steps served
    lately average `rows`."""
    return STARTUP_SLOWNESS - (STARTUP_SLOWNESS - 1.0) * min(1.0, rows / (STARTUP_NEAR * 512))


def trusted_capacity(clock: StepClock, slow: float) -> float:
    budget = clock.capacity_headroom * clock.period
    return min(512.0, clock.cost.capacity(budget, LIVES, 512.0, slow))


def test_a_light_load_leaves_the_assumed_slowness_where_the_startup_batch_sets_the_rows():
    # single streams before a burst (`voxpipe bench ttfa` measures one first): their steps keep
    # the fit, but say nothing of 512 rows
    clock = fresh(True)
    serve(clock, 800, 1.0, rows=16)
    assert clock.slowness() == pytest.approx(1.0) and clock.measured_rows() == 512.0
    assert clock.capacity(lives=LIVES) == pytest.approx(trusted_capacity(clock, assumed(16)))
    assert clock.capacity(lives=LIVES) < 512.0
    serve(clock, 300, 1.6, rows=16)  # slower than assumed: that counts
    assert clock.capacity(lives=LIVES) == pytest.approx(trusted_capacity(clock, clock.slowness()))
    assert clock.slowness() > STARTUP_SLOWNESS


def test_steps_served_at_half_the_startup_batch_speak_for_it():
    clock = fresh(True)
    serve(clock, 300, 1.05, rows=300, ctx=500)  # STARTUP_NEAR of 512 rows and more
    assert clock.measured_rows() == 512.0 and clock.slowness() < STARTUP_SLOWNESS
    assert clock.capacity(lives=LIVES) == pytest.approx(trusted_capacity(clock, clock.slowness()))
    light = fresh(True)
    serve(light, 300, 1.0, rows=200, ctx=500)  # below it: a share of the assumed slowness holds
    assert 1.0 < assumed(200) < STARTUP_SLOWNESS
    assert light.capacity(lives=LIVES) == pytest.approx(trusted_capacity(light, assumed(200)))


def test_the_assumed_slowness_fades_without_a_step_in_the_capacity():
    # a steady load just below STARTUP_NEAR of the startup batch gets about the capacity of one just
    # above it (a step there would hold the simulated H200 at 90 req/s near its load: p95 363 ms)
    below, above = fresh(True), fresh(True)
    serve(below, 300, 1.0, rows=250, ctx=500)
    serve(above, 300, 1.0, rows=262, ctx=500)
    assert below.capacity(lives=LIVES) == pytest.approx(above.capacity(lives=LIVES), rel=0.03)


def test_once_the_steps_served_reach_the_startup_batch_their_slowness_alone_counts():
    clock = fresh(True)
    serve(clock, 800, 1.1, rows=512, ctx=500)
    assert clock.slowness() == pytest.approx(1.1, rel=0.05)
    budget = clock.capacity_headroom * clock.period
    seen = clock.measured_rows()
    assert seen >= 512.0
    expect = clock.cost.capacity(budget, LIVES, seen, clock.slowness())
    assert clock.capacity(lives=LIVES) == pytest.approx(min(512.0, expect))


def test_the_startup_batches_count_until_the_fit_has_taken_its_steps_of_more_than_light_batches():
    clock = fresh(True)
    serve(clock, COST_STEPS, 1.0, rows=PROBE_MIN + 32)
    assert clock.measured_rows() == 512.0
    serve(clock, 1, 1.0, rows=PROBE_MIN + 32)
    assert clock.measured_rows() == PROBE_MIN + 32  # the steps served, from here on
    light = fresh(True)  # single streams and small batches for longer than the fit holds steps
    serve(light, COST_STEPS + 500, 1.0, rows=PROBE_MIN)
    assert light.measured_rows() == 512.0
    assert light.capacity(lives=LIVES) == pytest.approx(trusted_capacity(light, assumed(PROBE_MIN)))
    serve(light, 2 * PACE_STEPS, 1.0, rows=PROBE_MIN + 1)  # a burst's first steps: too few to speak
    assert light.measured_rows() == 512.0
    serve(light, COST_STEPS, 1.0, rows=PROBE_MIN + 1)
    assert light.measured_rows() == PROBE_MIN + 1


def test_the_startup_batches_count_again_once_the_heavy_steps_have_left_the_fits_window():
    # a burst's heavy steps end the trust; a long light spell after them (the heavy steps aged out
    # of the window `largest_fitted` looks at) makes the next burst's worker a fresh one again
    clock = fresh(True)
    serve(clock, COST_STEPS + 1, 1.0, rows=300)
    assert clock.measured_rows() == 300.0
    serve(clock, COST_STEPS - 1, 1.0, rows=PROBE_MIN)
    assert clock.measured_rows() == 300.0  # the last heavy step is still in the window
    serve(clock, PACE_STEPS + 1, 1.0, rows=PROBE_MIN)
    assert clock.largest_fitted() == PROBE_MIN and clock.measured_rows() == 512.0
    assert clock.capacity(lives=LIVES) == pytest.approx(trusted_capacity(clock, assumed(PROBE_MIN)))


def test_the_flag_reaches_the_workers_clock():
    s = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--no-trust-startup-steps"], {})
    assert s.cfg.gpu.trust_startup_steps is False
    assert parse_role("gpu_worker", ["--model", "orpheus-tiny"], {}).cfg.gpu.trust_startup_steps is True


def test_on_the_simulated_h200_a_burst_of_384_is_admitted_sooner_with_every_stream_on_time():
    kw = dict(tokens=400, ramp_s=0.0, duration_s=3.0, gpu=H200_RATE, calibrate=True, startup=H200_FORWARD,
              prompts_a_step=10, lead_borrow=True)  # fmt: skip
    base, trusted = simulate(384, **kw), simulate(384, trust_startup=True, **kw)
    assert base["on_time_share"] == trusted["on_time_share"] == 1.0
    assert trusted["capacity_min"] > base["capacity_min"]
    assert trusted["wait_p99_ms"] < 0.8 * base["wait_p99_ms"]
    assert trusted["ttfa_p99_ms"] < 0.8 * base["ttfa_p99_ms"]


def test_after_single_streams_a_burst_is_still_admitted_up_to_the_startup_steps():
    # `voxpipe bench ttfa` serves one stream at a time first, for more steps than the fit holds: a
    # trust that ends after the fit's first COST_STEPS steps is gone by the burst (on the H200 too)
    kw = dict(tokens=400, ramp_s=0.0, duration_s=8.0, gpu=H200_RATE, calibrate=True, startup=H200_FORWARD,
              prompts_a_step=10, before=(1,))  # fmt: skip
    base, trusted = simulate(384, **kw), simulate(384, trust_startup=True, **kw)
    assert base["on_time_share"] == trusted["on_time_share"] == 1.0
    assert trusted["capacity_min"] > 1.2 * base["capacity_min"]
    assert trusted["wait_p99_ms"] < 0.9 * base["wait_p99_ms"]
