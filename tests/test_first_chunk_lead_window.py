"""A request's first audio can come from a short lead window; the regular windows after it are the
reference's, unchanged, and the engine measures its step rate to decide when a lead is safe."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import LEAD_NOISE_BASE, Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.scheduler.pacing import PACE_REACH, PACE_STEPS, STALE_S, StepClock, lead_fits
from programs import get_spec, load_program_class

PROMPT = [128259, 300, 301, 302, 128009, 128260, 128261, 128257]


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    p.detok_lead = (7, 14, 21)  # the Orpheus lead sizes, set here so the test does not depend on them
    return p


def chunks_of(program, first_chunk: str, seed: int = 5, max_tokens: int = 120) -> list:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200, first_chunk=first_chunk))
    rows = np.array(PROMPT, dtype="<i4")
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=100, constrained=True, seed=seed)
    eng.add(Prompt("r", rows.tobytes(), len(rows), sp))
    return [c for batch in eng.run_until_idle() for c in batch.chunks]


def test_fastest_sends_one_frame_first_then_the_reference_windows_unchanged(program):
    ref = chunks_of(program, "reference")
    lead = chunks_of(program, "fastest")
    assert [c.index for c in lead] == list(range(len(lead)))
    first = np.frombuffer(lead[0].tokens, dtype="<i4")
    assert len(first) == 7 and lead[0].noise_id == LEAD_NOISE_BASE + 7
    # Window 0 (frame 1's audio) follows at once: the lead only added frame 0, which the
    # reference never plays. Same tokens, same noise streams as without the lead.
    assert [(c.tokens, c.noise_id) for c in lead[1:]] == [(c.tokens, c.noise_id) for c in ref]
    assert np.array_equal(first, np.frombuffer(ref[0].tokens, dtype="<i4")[:7])


def test_reference_mode_sends_no_lead(program):
    ref = chunks_of(program, "reference")
    assert all(len(c.tokens) == 28 * 4 for c in ref)
    assert [c.noise_id for c in ref] == list(range(len(ref)))


def test_slow_steps_still_send_the_largest_lead_so_the_audio_is_the_same(program, monkeypatch):
    """Adaptive mode on steps too slow for any smaller lead: the 21-row lead goes anyway, so the
    request's audio (the rows its chunks keep) is what a fast run sends, frame 0 included."""
    from gpu_worker.windows import AudioWindows

    def kept_rows(chunks) -> int:  # a lead keeps its R rows, a regular window its newest 7
        return sum(len(c.tokens) // 4 if c.noise_id >= LEAD_NOISE_BASE else 7 for c in chunks)

    fast = chunks_of(program, "fastest")
    monkeypatch.setattr(AudioWindows, "lead_now", lambda self, rows: False)
    slow = chunks_of(program, "adaptive")
    assert len(slow[0].tokens) == 21 * 4 and slow[0].noise_id == LEAD_NOISE_BASE + 21
    assert kept_rows(slow) == kept_rows(fast) == kept_rows(chunks_of(program, "reference")) + 7


def test_a_longer_lead_replaces_the_regular_windows_it_covers(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200, first_chunk="fastest"))
    # Window j's audio starts at row 7j + 7: a 14-row lead covers window 0, a 21-row lead 0 and 1.
    assert [eng.windows.first_window_after(r) for r in (7, 14, 21)] == [0, 1, 2]


def test_a_lead_is_sent_only_when_the_next_window_arrives_before_it_has_played():
    # One Orpheus frame is 85.3 ms of audio; the next window comes 21 rows after a one-frame lead.
    frame = 2048 / 24000
    assert lead_fits(21, frame, 0.003)  # 3 ms steps: 63 ms (82 with margin) < 85 ms
    assert not lead_fits(21, frame, 0.006)
    assert lead_fits(21, 3 * frame, 0.009)  # a three-frame lead covers slower steps
    assert not lead_fits(21, frame, 0.0)  # nothing measured yet: no lead


def test_capacity_follows_the_measured_step_times():
    clock = StepClock(rows_per_second=82.03, max_batch=512, headroom=0.92)
    assert clock.capacity() == 512  # nothing measured: the configured maximum
    for b, ms in ((64, 4.3), (128, 5.6), (256, 8.7)):
        for _ in range(10):
            clock.record(b, ms / 1000)
    # Extrapolated along the line from the smallest batch: 256 + (0.92 * 12.19 - 8.7) * 192 / 4.4
    # ≈ 366 streams.
    assert 355 < clock.capacity() < 375
    for _ in range(10):
        clock.record(362, 12.5 / 1000)  # measured too slow there: interpolate below it
    cap = clock.capacity()
    assert 256 < cap < 362
    assert clock.row_period() == pytest.approx(0.0125, rel=0.3)


def test_capacity_never_falls_below_a_batch_measured_on_time():
    clock = StepClock(rows_per_second=82.03, max_batch=512, headroom=0.92)
    for b in (186, 192, 189):  # all in the bucket keyed 181: its batches average 189
        for _ in range(10):
            clock.record(b, 0.0094)
    # One bucket measured: in proportion from its average batch (not its key, 181):
    # 189 * (0.92 * 12.19) / 9.4 ≈ 225.5.
    assert clock.capacity() == pytest.approx(225.5, abs=1)
    for _ in range(10):
        clock.record(235, 0.0118)  # past the budget (0.92 * 12.19 ms) at 235
    assert 189 <= clock.capacity() < 235
    steep = StepClock(rows_per_second=82.03, max_batch=512, headroom=0.92)
    for b, ms in ((152, 9.6), (192, 11.1)):  # neighbours: no slope, in proportion from 192
        for _ in range(10):
            steep.record(b, ms / 1000)
    assert 192 < steep.capacity() < 200


def test_a_burst_of_slow_steps_does_not_cut_the_capacity_below_the_streams_served():
    clock = StepClock(82.03, 512, headroom=0.8)  # budget 0.8 * 12.19 = 9.75 ms
    for b, ms in ((160, 6.6), (210, 7.4)):
        for _ in range(200):
            clock.record(b, ms / 1000)
    for _ in range(400):  # ~3 s at 240 streams, on time
        clock.record(240, 8.0 / 1000)
    steady = clock.capacity()
    assert steady > 240
    for _ in range(25):  # a burst of arrivals: a prefill in each of the next 25 steps
        clock.record(240, 13.0 / 1000)
    assert clock.capacity() > 240  # still admits up to what runs on time
    for _ in range(300):  # the steps stay slow: now it is the worker's pace
        clock.record(240, 13.0 / 1000)
    assert clock.capacity() < 240


def test_capacity_extrapolates_a_bounded_step_beyond_what_was_measured():
    shallow = StepClock(rows_per_second=82.03, max_batch=512, headroom=0.92)
    for b, ms in ((128, 8.6), (192, 9.4)):  # the line from 128 crosses the budget at ~337
        for _ in range(10):
            shallow.record(b, ms / 1000)
    assert shallow.capacity() == pytest.approx(1.5 * 192)  # no more than half again beyond 192
    flat = StepClock(82.03, 512, headroom=0.8)  # budget 9.75 ms
    for b, ms in ((185, 8.70), (200, 8.75)):  # neighbours a hair apart: no slope to trust
        for _ in range(10):
            flat.record(b, ms / 1000)
    assert flat.capacity() == pytest.approx(200 * 0.8 / 82.03 / 0.00875, abs=1)
    idle = StepClock(82.03, 512)
    for _ in range(10):
        idle.record(1, 0.0034)  # one stream on a GPU with room to spare: probe from there
    assert idle.capacity() == pytest.approx(1 + 64)


def test_a_batch_measured_slow_long_ago_stops_capping_the_capacity():
    clock = StepClock(rows_per_second=82.03, max_batch=512, headroom=0.92)
    for b, ms in ((64, 4.3), (128, 5.6)):
        for _ in range(10):
            clock.record(b, ms / 1000, now=100.0)
    for _ in range(10):
        clock.record(181, 14.0 / 1000, now=100.0)  # a burst: slow steps at 181
    assert clock.capacity(now=101.0) < 181
    for b, ms in ((64, 4.3), (128, 5.6)):  # admission kept batches small since
        for _ in range(10):
            clock.record(b, ms / 1000, now=100.0 + STALE_S + 5)
    # The old slow bucket no longer counts: extrapolate from what is current, and probe again.
    assert clock.capacity(now=100.0 + STALE_S + 5) > 181


def test_promises_to_a_listener_are_made_on_slow_steps_not_average_ones():
    steady, uneven = StepClock(82.03, 512), StepClock(82.03, 512)
    for i in range(40):
        steady.record(128, 0.008)
        uneven.record(128, 0.006 if i % 4 else 0.014)  # every fourth step shares the GPU with a codec pass
    assert steady.row_period_high() == pytest.approx(steady.row_period())
    assert uneven.row_period() < 0.0085 < 0.010 < uneven.row_period_high()
    # One frame (85.3 ms) as a first chunk: its next frame, 7 steps away, comes in time at 7.4 ms
    # a step (7 * 7.4 * 1.15 + 25 = 84.6 ms), not at the uneven clock's slow pace.
    frame = 2048 / 24000
    assert lead_fits(7, frame, 0.0074, latency_s=0.025)
    assert not lead_fits(7, frame, uneven.row_period_high(), latency_s=0.025)


def test_the_next_frame_is_timed_by_the_spans_of_recent_steps():
    frame = 2048 / 24000
    clock = StepClock(82.03, 512)
    for i in range(96):
        clock.record(192, 0.030 if i % 12 == 0 else 0.009)  # a prefill step now and then
    # Seven steps hold at most one slow step: 6 * 9 + 30 = 84 ms. Charging the slow step's spread
    # to every row says more, and would hold first chunks for a third frame sooner.
    assert clock.rows_time_high(7) == pytest.approx(0.084, abs=1e-6)
    assert clock.rows_time_high(7) < 7 * clock.row_period_high()
    assert lead_fits(7, 2 * frame, clock.rows_time_high(7) / 7, latency_s=0.025)
    for _ in range(3):
        clock.record(192, 0.030)  # the steps just got slower: the latest span says so at once
    assert clock.rows_time_high(7) == pytest.approx(4 * 0.009 + 3 * 0.030, abs=1e-6)
    fresh = StepClock(82.03, 512)
    for _ in range(10):
        fresh.record(64, 0.005)
    assert fresh.rows_time_high(7) == pytest.approx(7 * fresh.row_period_high())  # too few yet
    clock.tick(0)  # the engine went idle: the next requests start from a clean slate
    assert clock.rows_time_high(7) == pytest.approx(7 * clock.row_period_high())


def test_noise_between_neighbouring_batches_does_not_swing_the_capacity():
    clock = StepClock(82.03, 512, headroom=0.8)  # budget 0.8 * 12.19 = 9.75 ms a step
    for b, ms in ((64, 4.3), (185, 8.8), (200, 8.7)):  # 200 measured a little faster than 185
        for _ in range(10):
            clock.record(b, ms / 1000)
    # The slope from 185 to 200 is negative: the line from 64 to 200 is what extrapolates.
    assert clock.capacity() == pytest.approx(200 + (0.8 / 82.03 - 0.0087) * 136 / 0.0044, abs=1)


def test_a_bucket_measured_slow_in_a_burst_does_not_hold_the_capacity_at_the_load():
    clock = StepClock(82.03, 512, headroom=0.88)  # budget 0.88 * 12.19 = 10.73 ms
    for b, ms, n in ((256, 8.0, 300), (314, 8.8, 300), (340, 14.0, 20), (314, 8.8, 50)):
        for _ in range(n):  # 340: a burst of admissions, a prompt in every step
            clock.record(b, ms / 1000)
    # The buckets alone: interpolated between 314 (on time) and 340 (slow), just above the load.
    assert 314 <= clock._model_capacity(None) < 330
    # The pace of the last ~100 steps, burst included, allows more in proportion.
    assert clock.capacity() == pytest.approx(clock.paced_capacity())
    assert clock.capacity() > 350


def test_admitting_up_to_the_paced_capacity_converges_on_the_budget_from_below():
    budget = 0.8 / 82.03  # 9.75 ms
    for fixed_ms, per_stream_ms in ((3.0, 0.02), (6.0, 0.01), (1.0, 0.03)):
        clock = StepClock(82.03, 512, headroom=0.8)
        limit = (budget * 1000 - fixed_ms) / per_stream_ms  # the batch whose step takes the budget
        batch, worst = 8, 0.0
        for i in range(3000):  # 500 streams offered: the batch follows the capacity, a stream a step
            batch = max(1, min(500, batch + 1, int(clock.paced_capacity() or batch + 1)))
            clock.record(batch, (fixed_ms + per_stream_ms * batch) / 1000)
            if i > 500:
                worst = max(worst, batch)
        assert worst <= limit + 1
        assert clock.paced_capacity() == pytest.approx(limit, rel=0.03)


def test_graph_padding_lets_admission_overshoot_the_budget_only_slightly():
    budget = 0.8 / 82.03
    for fixed_ms, per_stream_ms in ((3.0, 0.02), (1.0, 0.03)):
        clock = StepClock(82.03, 512, headroom=0.8)
        batch, steps, now = 8, [], 0.0
        for i in range(4000):  # every step pads its batch to a multiple of 32, as the decode graphs do
            now += 0.01
            batch = max(1, min(500, batch + 4, int(clock.capacity(now=now))))
            step = (fixed_ms + per_stream_ms * math.ceil(batch / 32) * 32) / 1000
            clock.record(batch, step, now=now)
            if i > 1000:
                steps.append(step)
        steps.sort()
        assert sum(steps) / len(steps) <= 1.01 * budget
        assert steps[int(0.99 * len(steps))] <= 1.1 * budget


def test_the_pace_counts_only_after_enough_steps_since_idle_and_reaches_a_bounded_step():
    clock = StepClock(82.03, 512, headroom=0.8)
    for _ in range(PACE_STEPS - 1):
        clock.record(100, 0.004)
    assert clock.paced_capacity() == 0.0  # too few steps to trust
    clock.record(100, 0.004)
    # 100 * 9.75 / 4 = 244 in proportion, but no more than PACE_REACH beyond the 100 served
    assert clock.paced_capacity() == pytest.approx(100 * (1 + PACE_REACH))
    clock.tick(0)  # idle: the pace starts again
    assert clock.paced_capacity() == 0.0
