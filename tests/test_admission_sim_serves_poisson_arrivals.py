"""Open-loop Poisson arrivals on the simulated GPU of bench/admission_sim.py (`voxpipe bench sim
--rate`), with the engine's own clock, admission and first-chunk promises: requests come at the
times of a Poisson process whatever the worker serves; at a light load a first chunk goes out after
one frame, about eight steps (its prompt's and a frame's) and the codec's trip after it came; where
the steps' pessimistic pace passes the one-frame bound it waits for two; and past the worker's
capacity the requests wait at admission while every stream admitted stays on time."""

from __future__ import annotations

import math

import numpy as np

from bench.admission_sim import CODEC_S, FRAME, GPU, H200_BATCHED, ONE_FRAME_S, Poisson, simulate_poisson
from gpu_worker.scheduler.pacing import lead_fits

# A GPU a quarter of the H200's size: ~130 streams of 360 rows keep real time.
SMALL = GPU(fixed_ms=3.0, row_us=36.0, row_us_per_1k_ctx=72.0, prompt_ms=1.6, extra_prompt_ms=3.3)


def test_arrivals_come_at_the_rate_asked_with_exponential_gaps():
    rate, duration = 80.0, 30.0
    times = np.array(Poisson(rate, 0.0, duration, np.random.default_rng(3)).times)
    expected = rate * duration
    assert abs(len(times) - expected) <= 4 * math.sqrt(expected)
    assert (np.diff(times) > 0).all() and 0.0 < times[0] and times[-1] < duration
    gaps = np.diff(times)
    assert abs(gaps.mean() * rate - 1.0) < 0.05
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential: as spread as long
    # the same seed, the same arrivals; and the simulation serves each of them once
    again = Poisson(rate, 0.0, duration, np.random.default_rng(3)).times
    assert again == list(times)
    served = simulate_poisson(20.0, duration_s=6.0, seed=1)
    assert abs(served["requests"] - 120) <= 4 * math.sqrt(120)
    assert served == simulate_poisson(20.0, duration_s=6.0, seed=1)


def test_the_one_frame_bound_is_where_lead_fits_holds_for_a_frame():
    audio = FRAME / 82.03
    assert lead_fits(FRAME, audio, ONE_FRAME_S * 0.999, latency_s=0.025)
    assert not lead_fits(FRAME, audio, ONE_FRAME_S * 1.001, latency_s=0.025)
    assert 0.0074 < ONE_FRAME_S < 0.0076


def test_a_light_load_sends_every_first_chunk_after_one_frame():
    r = simulate_poisson(5.0, duration_s=4.0, gpu=H200_BATCHED, prompts_a_step=9)
    assert r["first_frames"] == {1: 1.0, 2: 0.0, 3: 0.0}
    assert r["on_time_share"] == 1.0
    step = r["row_period_mean_ms"]
    # a prompt's step and a frame's seven, the codec's trip, and up to a step waiting for the next
    assert 7 * step + 1000 * CODEC_S <= r["ttfa_p50_ms"] <= 9 * step + 1000 * CODEC_S + step
    assert r["ttfa_p99_ms"] < 50.0


def test_first_chunks_wait_for_two_frames_where_the_steps_pass_the_one_frame_bound():
    r = simulate_poisson(60.0, duration_s=6.0, gpu=SMALL, calibrate=True)
    assert r["first_period_high_p50_ms"] > 1000 * ONE_FRAME_S
    assert r["first_frames"][2] > 0.5 and r["first_frames"][3] == 0.0


def test_a_rate_past_capacity_waits_at_admission_and_the_streams_admitted_stay_on_time():
    r = simulate_poisson(100.0, duration_s=4.0, gpu=SMALL, calibrate=True)
    assert abs(r["requests"] - 400) <= 4 * math.sqrt(400)  # every request sent ends, late or not
    assert r["admitted_max"] <= 1.15 * r["capacity_p50"] < 170
    assert r["wait_p99_ms"] > 1000.0
    assert r["on_time_share"] >= 0.99
