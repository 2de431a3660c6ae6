"""bench/admission_sim.py `--codec`: the codec worker between the steps and the listeners. Windows
wait as codec_worker/gather.py keeps them (until the earliest deadline, the gather's longest wait,
or a full batch); a pass decodes all of them, the urgent requests' group first (no slack, or less
left than a pass takes and the margin), each kind of window
a launch; a listener is late where a chunk comes after the audio before it has played. On the
simulated H200 its passes come as the H200's load runs read them."""

from __future__ import annotations

import pytest

from bench.admission_sim import (
    FULL_TAIL_KIND,
    H200_FORWARD,
    H200_POISSON,
    H200_RATE,
    REGULAR_KIND,
    Codec,
    simulate,
    simulate_poisson,
)


def request() -> dict:
    return {"late": 0.0}


def test_a_first_chunk_goes_at_once_and_a_window_with_slack_waits_for_the_gather():
    codec = Codec(
        launch_ms=2.0, window_ms=0.5, graph_window_ms=0.5, max_wait_s=0.030, margin_s=0.020, trip_s=0.001
    )
    ahead, young = request(), request()
    ahead["heard"] = 0.0
    codec.add(ahead, 1.000, slack_s=0.5, audio_before_s=1.5, kind=REGULAR_KIND)
    codec.advance(1.020)
    assert codec.passes == []  # half a second in hand: it waits up to max_wait_s
    codec.add(young, 1.021, slack_s=0.0, audio_before_s=0.0, kind=(7, 0), first=True)
    codec.advance(1.021)
    # one pass at once: the first chunk's group (a launch, a window), then the rest's
    ((start, took, windows),) = codec.passes
    assert start == 1.021 and windows == 2 and took == pytest.approx(0.005)
    assert young["heard"] == pytest.approx(1.021 + 0.0025 + 0.001)
    assert codec.first_waits == [(1.021, pytest.approx(0.0035))]
    assert ahead["late"] == 0.0


def test_a_full_batch_goes_at_once_and_a_pass_slower_than_the_slack_makes_its_listener_late():
    codec = Codec(launch_ms=2.0, window_ms=1.0, full_batch=4, trip_s=0.0, max_wait_s=0.030)
    listeners = [request() | {"heard": 0.0} for _ in range(4)]
    for r in listeners[:3]:  # a second in hand each: only a full batch sends them before 30 ms
        codec.add(r, 1.0, slack_s=1.0, audio_before_s=2.0, kind=REGULAR_KIND)
    codec.advance(1.010)
    assert codec.passes == []
    # the fourth fills the batch; its audio before it plays out 3 ms after it leaves (its 23 ms of
    # slack, less the margin, would not send it yet)
    codec.add(listeners[3], 1.010, slack_s=0.023, audio_before_s=1.013, kind=REGULAR_KIND)
    codec.advance(1.010)
    ((start, took, windows),) = codec.passes
    assert (start, windows) == (1.010, 4) and took == pytest.approx(0.006)
    assert listeners[3]["late"] == pytest.approx(0.003)  # heard at 1.016, its audio due at 1.013
    assert [r["late"] for r in listeners[:3]] == [0.0, 0.0, 0.0]


def test_a_window_with_less_left_than_a_pass_and_the_margin_goes_in_the_urgent_group():
    codec = Codec(launch_ms=2.0, window_ms=1.0, trip_s=0.0, max_wait_s=0.030, margin_s=0.020)
    relaxed, tight = request() | {"heard": 0.0}, request() | {"heard": 0.0}
    codec.add(relaxed, 1.0, slack_s=1.0, audio_before_s=2.0, kind=REGULAR_KIND)
    # 15 ms of audio left, under the margin: decoded on its own first (3 ms), in time for its 3.5 ms;
    # in one group with the other window it would take 4 ms and come late
    codec.add(tight, 1.0, slack_s=0.015, audio_before_s=1.0035, kind=REGULAR_KIND)
    codec.advance(1.0)
    ((start, took, windows),) = codec.passes
    assert (start, windows) == (1.0, 2) and took == pytest.approx(0.006)
    assert tight["late"] == 0.0 and relaxed["late"] == 0.0


def test_kinds_cost_a_launch_each_tails_their_graphs_and_a_busy_codec_holds_the_next_pass():
    codec = Codec(launch_ms=2.0, window_ms=0.1, graph_window_ms=0.3, trip_s=0.0)
    for kind in (FULL_TAIL_KIND, REGULAR_KIND, REGULAR_KIND):
        codec.add(request() | {"heard": 0.0}, 1.0, slack_s=0.0, audio_before_s=5.0, kind=kind)
    codec.advance(1.0)
    assert codec.passes[0][1] == pytest.approx(0.0045)  # one group: two kinds, a graphed window
    codec.add(request(), 1.001, slack_s=0.0, audio_before_s=0.0, kind=(14, 0), first=True)
    codec.advance(1.010)
    assert codec.passes[1][0] == pytest.approx(1.0045)  # after the pass before it
    compiled = Codec(launch_ms=2.0, window_ms=0.1, graph_window_ms=0.3, trip_s=0.0, compiled_tails=True)
    for kind in (FULL_TAIL_KIND, REGULAR_KIND, REGULAR_KIND):
        compiled.add(request() | {"heard": 0.0}, 1.0, slack_s=0.0, audio_before_s=5.0, kind=kind)
    compiled.advance(1.0)
    assert compiled.passes[0][1] == pytest.approx(0.0043)  # the full tail decodes as a regular window


def test_on_the_simulated_h200_a_bursts_passes_come_as_the_h200s_and_poisson_arrivals_two_frame_first_chunks():
    kw = dict(calibrate=True, startup=H200_FORWARD, prompts_a_step=10, codec=True)
    burst = simulate(256, tokens=1024, ramp_s=0.0, duration_s=8.0, gpu=H200_RATE, **kw)
    # the H200's bursts of 256: 39-40 passes a second of 118-121 windows, busy 0.56-0.59
    assert 30 <= burst["codec_passes_per_s"] <= 45
    assert 100 <= burst["codec_windows_per_pass"] <= 140
    assert 0.45 <= burst["codec_busy_share"] <= 0.7
    assert burst["on_time_share"] == 1.0
    poisson = simulate_poisson(80.0, duration_s=8.0, gpu=H200_POISSON, **kw)
    # the H200 at 80 req/s: ~228 streams at 7.2 ms a step, most first chunks of two frames
    assert 190 <= poisson["streams_mean"] <= 240
    assert poisson["first_frames"][2] > 0.6
    assert poisson["ttfa_p50_ms"] > 100.0


def test_a_fast_admitted_burst_is_late_at_the_codec_unless_full_tails_decode_as_regular_windows():
    # the H200's bursts of 384 admitted fast: many streams late a second in, by up to ~200 ms
    kw = dict(gpu=H200_RATE, calibrate=True, startup=H200_FORWARD, prompts_a_step=10, codec=True, lead_borrow=True,
              trust_startup=True, tokens=1024, ramp_s=0.0, duration_s=6.0)  # fmt: skip
    graphed, compiled = simulate(384, **kw), simulate(384, compiled_tails=True, **kw)
    assert graphed["on_time_share"] < 0.6 and graphed["worst_late_ms"] > 100.0
    assert compiled["on_time_share"] > 0.8 and compiled["worst_late_ms"] < 30.0
