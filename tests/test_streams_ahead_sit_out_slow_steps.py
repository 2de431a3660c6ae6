"""Streams far ahead of their listeners sit out steps that run over the budget
(gpu_worker.scheduler.sit_out.SitOut): only those, only while steps are slow, never down to a gap, the rows
left a graph bucket's size; and a request's tokens are the same whether it sat steps out or not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.graphs import decode_buckets
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.sit_out import SitOut

PERIOD = 1 / 82.03  # an Orpheus row's playback time
BUDGET = 0.88 * PERIOD
SPARE_LEAD_S = GpuWorkerSettings().sit_out_lead_s


def clock_at(interval: float, batch: int = 300) -> StepClock:
    clock = StepClock(82.03, 512, headroom=0.88)
    for _ in range(20):
        clock.record(batch, interval)
    return clock


def test_no_stream_sits_out_while_steps_keep_the_budget():
    sit = SitOut(clock_at(0.95 * BUDGET))
    leads = [5.0] * 300
    for _ in range(50):
        assert sit.choose(leads) == []
    assert sit.share == 0.0


def test_only_streams_with_audio_to_spare_sit_out_the_most_ahead_first():
    sit = SitOut(clock_at(1.2 * BUDGET))
    # 100 streams just started (no chunk yet, or still in their first frames), 100 a little ahead,
    # 100 well ahead with distinct leads.
    leads = [-math.inf] * 100 + [0.9 * SPARE_LEAD_S] * 100 + [SPARE_LEAD_S + 0.01 * i for i in range(100)]
    out = []
    for _ in range(200):  # the share climbs while the interval stays over the budget
        out = sit.choose(leads)
    assert out and all(leads[i] >= SPARE_LEAD_S for i in out)
    assert sorted(out) == list(range(300 - len(out), 300))  # the largest leads
    assert sit.share <= 100 / 300  # never beyond the streams ahead


def test_the_rows_left_are_a_decode_bucket():
    sizes = decode_buckets(512)
    sit = SitOut(clock_at(1.1 * BUDGET), sizes)
    for n in (390, 384, 300, 170):
        sit.share = 0.0
        leads = [5.0] * n
        for _ in range(40):
            out = sit.choose(leads)
            if out:
                assert n - len(out) in sizes
        assert out


def simulate(n_new: int, n_ahead: int, fixed_ms: float, per_row_ms: float, steps: int, sit_out: bool):
    """Steps of fixed + per-row time over n_new streams just started (0.2 s in hand) and n_ahead
    streams with SPARE_LEAD_S + 0.3 s; each row in a step gives its stream one row of audio. →
    (intervals, the new streams' mean lead after 200 steps, the least lead of a stream left out)."""
    clock = StepClock(82.03, 512, headroom=0.88)
    sit = SitOut(clock, decode_buckets(512))
    lead = np.array([0.2] * n_new + [SPARE_LEAD_S + 0.3] * n_ahead)
    intervals, new_at_200, least_out = [], 0.0, math.inf
    for step in range(steps):
        eligible = [x if x >= SPARE_LEAD_S else -math.inf for x in lead]  # past their first frames
        out = set(sit.choose(eligible)) if sit_out else set()
        if out:
            least_out = min(least_out, min(lead[i] for i in out))
        batch = len(lead) - len(out)
        dt = (fixed_ms + per_row_ms * batch) / 1000
        clock.record(batch, dt, streams=len(lead))
        served = np.array([i not in out for i in range(len(lead))])
        lead += np.where(served, PERIOD, 0.0) - dt
        intervals.append(dt)
        if step == 200:
            new_at_200 = lead[:n_new].mean()
    return np.array(intervals), new_at_200, least_out


def test_sitting_out_brings_slow_steps_to_the_budget():
    # 400 streams at 3 ms + 21 us a row: 11.4 ms a step, over the 10.73 ms budget (not the period).
    args = dict(n_new=100, n_ahead=300, fixed_ms=3.0, per_row_ms=0.021, steps=1500)
    plain, new_plain, _ = simulate(**args, sit_out=False)
    paced, new_paced, least_out = simulate(**args, sit_out=True)
    assert plain.mean() > 1.05 * BUDGET
    assert paced[500:].mean() <= 1.01 * BUDGET  # the share settled where the interval meets the budget
    assert least_out >= SPARE_LEAD_S  # only streams with the spare in hand sat out
    assert new_paced > new_plain  # and the new streams gained their lead faster


def test_streams_ahead_carry_a_load_over_the_period_with_what_they_have_to_spare():
    # 3 ms + 28 us a row: 14.2 ms a step for all 400, over the row period itself (admission would
    # not let it last). The streams ahead sit out while they have the spare, never below it.
    paced, new_paced, least_out = simulate(100, 300, 3.0, 0.028, 700, sit_out=True)
    plain, new_plain, _ = simulate(100, 300, 3.0, 0.028, 700, sit_out=False)
    assert least_out >= SPARE_LEAD_S
    assert paced[:150].mean() < 0.95 * plain.mean()  # shorter steps while the spare lasts
    assert new_paced > new_plain  # for the new streams


def test_the_pace_counts_streams_sitting_out_as_served_up_to_what_its_rows_keep_real_time():
    clock = StepClock(82.03, 512, headroom=0.88)
    for _ in range(200):
        clock.record(352, BUDGET, streams=400)  # 48 sat each step out; steps at the budget
    assert clock.paced_capacity() == pytest.approx(400, rel=1e-6)
    clock = StepClock(82.03, 512, headroom=0.88)
    for _ in range(200):
        clock.record(300, BUDGET, streams=400)  # 100 out: more than the headroom makes up for
    # 300 rows a step at 0.88 of a row period keep 300 / 0.88 = 341 streams at real time.
    assert clock.paced_capacity() == pytest.approx(300 / 0.88, rel=1e-6)


@pytest.fixture(scope="module")
def tiny():
    """orpheus-tiny in float64. Sitting out changes the batch sizes, and on the CPU a GEMM of one row
    (a matrix-vector product) rounds otherwise than the same row among others: in float32 a sampled
    request drew another token at row 124 of 253 for that alone. The GPU's fp8 GEMMs give one row
    the same bits at any batch (bench/op_invariance.py); float64 keeps such rounding far below any
    sampling boundary, so the test sees the engine's bookkeeping only. The audio-only head (28,673
    of 156,940 columns) keeps its float64 GEMM small: every token a constrained request can draw is
    in it."""
    import torch

    from programs import get_spec, load_program_class

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = load_program_class("orpheus-tiny")(
            get_spec("orpheus-tiny"), load_format="dummy", dtype=torch.float64, lm_head="audio"
        )
        p.load_lm()
        yield p
    finally:
        torch.set_num_threads(before)


def run(program, sit_out: float, max_lead: float = 0.0) -> tuple[dict, list[float], bool]:
    """Six requests, one starting every 25 steps, on a fake clock: each step takes STEP_S, over a
    budget made smaller than that, and the listeners' clocks run with it. → (outputs, the audio in
    hand of every stream left out of a step at that step, whether the clock was told of streams
    served beyond the rows)."""
    limits = GpuWorkerSettings(
        max_batch_size=8, max_context=400, first_chunk="fastest", sit_out_lead_s=sit_out, max_lead_s=max_lead
    )
    eng = Engine(program, limits)
    eng.outputs = {}
    eng.clock.headroom = 0.25  # a budget of 3 ms a step: every step of STEP_S runs over it
    now = [1000.0]
    beyond = [False]

    def tick(batch: int, streams: int = 0, cost=None) -> None:
        now[0] += STEP_S
        beyond[0] |= streams > batch
        if batch:
            eng.clock.record(batch, STEP_S, streams=streams)

    eng.clock.tick = tick
    eng.windows.now = lambda: now[0]
    left_out: list[float] = []
    choose = eng.scheduler.leave_out_streams_ahead

    def checked(batch, prompts):
        kept = choose(batch, prompts)
        ids = {id(r) for r in kept}
        # What its listener has in hand: audio sent, less what has played since its first chunk.
        left_out.extend(r.sent_s - (now[0] - r.t_first) for r in batch if id(r) not in ids)
        return kept

    eng.scheduler.leave_out_streams_ahead = checked
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    for step in range(3000):
        if step % 25 == 0 and step // 25 < 6:
            i = step // 25
            sp = SamplingParams(max_tokens=220, constrained=True, seed=i, temperature=0.0 if i % 2 else 0.8)
            eng.add(Prompt(f"r{i}", rows.tobytes(), len(rows), sp))
        elif not eng.has_work():
            break
        eng.step()
    assert not eng.has_work(), "the engine did not finish"
    assert eng.allocator.num_used == 0 and not eng.running
    return eng.outputs, left_out, beyond[0]


STEP_S = 0.004  # a step's time: the listeners' audio, 12.2 ms a row, builds up ahead of them


def test_a_stream_samples_the_same_tokens_whether_it_sat_steps_out_or_not(tiny):
    plain, none_out, _ = run(tiny, sit_out=0.0)
    paced, left_out, beyond = run(tiny, sit_out=SPARE_LEAD_S)
    assert none_out == [] and len(left_out) > 50
    # Only streams with the spare lead in hand sat out, and the pace counted them as served.
    assert min(left_out) >= SPARE_LEAD_S
    assert beyond
    assert sorted(paced) == sorted(plain) == [f"r{i}" for i in range(6)]
    for rid, (tokens, reason) in plain.items():
        assert paced[rid][1] == reason
        assert paced[rid][0] == tokens, rid


def test_streams_past_the_max_lead_sit_out_every_step_and_sample_the_same_tokens(tiny):
    """`--max-lead 1`: steps of 4 ms make 12.2 ms of audio a row, so every stream runs ahead of its
    listener until it holds a second of audio; from then on it sits out steps (even with sit-out
    off and steps within their budget) and its listener never holds much more than the cap."""
    plain, _, _ = run(tiny, sit_out=0.0)
    capped, left_out, _ = run(tiny, sit_out=0.0, max_lead=1.0)
    assert len(left_out) > 100 and min(left_out) >= 1.0
    assert max(left_out) < 1.0 + 0.1  # a chunk's audio past the cap, at most
    assert sorted(capped) == sorted(plain)
    for rid, (tokens, reason) in plain.items():
        assert capped[rid] == (tokens, reason), rid
