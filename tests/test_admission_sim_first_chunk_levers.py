"""The first-chunk levers bench/admission_sim.py weighs (`voxpipe bench sim --first-quantile / --first-margin
/ --prompts-while-first`): the first-chunk decision on a lower quantile of the clock's spans or a
smaller margin sends more first chunks after one frame, at the cost of the second chunk's slack;
and while a first chunk waits, a step starts no more prompts than the cap."""

from __future__ import annotations

import numpy as np
import pytest

from bench.admission_sim import H200_RATE, new_worker, one_frame_s, simulate_poisson, span_high
from gpu_worker.scheduler.pacing import SPAN_QUANTILE, StepClock
from gpu_worker.windows import DELIVERY_S, LANE_ROOM


def test_the_span_high_at_the_engines_quantile_is_the_clocks():
    clock, rng, t = StepClock(82.03, 512), np.random.default_rng(0), 0.0
    for _ in range(120):
        dt = 0.007 * (1 + 0.2 * rng.standard_normal()) + (0.004 if rng.random() < 0.3 else 0.0)
        t += dt
        clock.record(200, dt, now=t, streams=200)
    assert span_high(clock, 7, SPAN_QUANTILE) == clock.rows_time_high(7)
    assert span_high(clock, 7, 0.8) < span_high(clock, 7, 0.9) < clock.rows_time_high(7)


def test_a_step_starts_at_most_the_cap_of_prompts_while_a_first_chunk_waits():
    w = new_worker(gpu=H200_RATE, tokens=360, prompts_a_step=10)
    streaming = {c: dict(first=0.1, gen=30) for c in range(4)}
    assert w.prompts_next(streaming) == w.prompts_now(streaming) == 10  # nothing measured: the most
    w.prompts_while_first = 1
    assert w.prompts_next(streaming) == 10
    assert w.prompts_next({**streaming, 9: dict(first=None, gen=3)}) == 1


def test_a_less_pessimistic_first_frame_sends_more_first_chunks_alone_and_spends_the_seconds_slack():
    # the load still growing at the end: a quarter of the first chunks wait for two frames
    kw = dict(gpu=H200_RATE, prompts_a_step=10, calibrate=True, duration_s=4.0)
    base = simulate_poisson(90.0, **kw)
    assert 0.1 < base["first_frames"][2] < 0.5
    for lever in (dict(first_quantile=0.8), dict(first_margin=1.0)):
        r = simulate_poisson(90.0, **kw, **lever)
        assert r["first_frames"][1] > base["first_frames"][1] + 0.1
        assert r["ttfa_p50_ms"] <= base["ttfa_p50_ms"]
        assert 0.0 < r["second_slack_p1_ms"] < base["second_slack_p1_ms"]
        assert r["on_time_share"] == 1.0  # the sim's trip is constant: no jitter to spend the slack


def test_the_simulated_lanes_trip_holds_within_the_lanes_room_as_the_engines_does():
    # the first-chunk decision and the first-audio sit-out's pace follow windows.second_trip_s
    w = new_worker(gpu=H200_RATE, tokens=360, delivery_s=0.015, first_audio=True, first_margin=1.0)
    w.load = LANE_ROOM
    assert w.trip_s() == 0.015
    assert w.first_audio.bound() == pytest.approx(one_frame_s(1.0, 0.015))
    w.load = LANE_ROOM + 0.01
    assert w.trip_s() == DELIVERY_S
    assert w.first_audio.bound() == pytest.approx(one_frame_s(1.0, DELIVERY_S))
    assert new_worker(gpu=H200_RATE, tokens=360).trip_s() == DELIVERY_S  # without the lane: any load
    w = new_worker(gpu=H200_RATE, tokens=360, delivery_s=0.015, lane_room=1.0)  # --lane-room
    w.load = 0.9
    assert w.trip_s() == 0.015
