"""`--lead-borrow`: while prompts wait, a step may run past its budget by what every playing stream's
listener has in hand beyond its next chunk's wait (`pacing.step_allowance`), up to BORROW_MAX
budgets. A stream that has just started playing spares nothing, so the step keeps its budget; a
stream well ahead lets the step start more prompts; and the next steps' expected time, on which
first chunks are promised, is the heavier step's. On the simulated H200 a burst from idle starts
sooner, every stream on time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.admission_sim import H200_FORWARD, H200_RATE, simulate
from common.config import GpuWorkerSettings
from common.messages import DetokChunk, Prompt, SamplingParams
from gpu_worker import stages
from gpu_worker.engine import Engine
from gpu_worker.scheduler.pacing import BORROW_MAX, StepClock, borrowable, step_allowance, withheld
from gpu_worker.stages import StageReporter
from gpu_worker.windows import AudioWindows
from programs import get_spec, load_program_class

ROWS = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
BUDGET = 0.88 / 82.03  # a step budget: 0.88 of a 12.19 ms row


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", lm_head="audio")
    p.load_lm()
    return p


def test_the_allowance_is_the_least_any_playing_stream_can_spare():
    def high(rows: int) -> float:  # 10 ms a row at the pessimistic rate
        return 0.010 * rows

    assert step_allowance([], high) == math.inf  # no stream plays: nothing to keep
    # 0.5 s in hand, its chunk after this step and 6 more: (0.5 - 0.025 - 1.15 * 0.06) / 1.15
    one = step_allowance([(0.5, 7)], high, 1.15, 0.025)
    assert one == pytest.approx((0.5 - 0.025 - 1.15 * 0.060) / 1.15)
    assert step_allowance([(0.5, 7), (0.1, 1), (2.0, 3)], high, 1.15, 0.025) == pytest.approx(
        (0.1 - 0.025) / 1.15
    )  # the stream whose chunk comes after this step, with the least in hand
    assert step_allowance([(0.05, 7)], high, 1.15, 0.025) < 0  # already short: nothing to spare

    assert borrowable(math.inf, BUDGET) == pytest.approx((BORROW_MAX - 1) * BUDGET)  # at most
    assert borrowable(0.5 * BUDGET, BUDGET) == 0.0  # less than the budget itself: no borrowing
    assert borrowable(1.5 * BUDGET, BUDGET) == pytest.approx(0.5 * BUDGET)
    assert borrowable(1.5 * BUDGET, BUDGET, slowness=1.5) == 0.0  # steps run 1.5x the fit
    # --lead-borrow-max: the most a step takes, in budgets; 1 lends nothing
    assert borrowable(math.inf, BUDGET, most=4.0) == pytest.approx(3 * BUDGET)
    assert borrowable(3 * BUDGET, BUDGET, most=4.0) == pytest.approx(2 * BUDGET)
    assert borrowable(math.inf, BUDGET, most=1.0) == 0.0
    with pytest.raises(ValueError, match="--lead-borrow-max"):
        GpuWorkerSettings(lead_borrow_max=0.5).check()
    # what a step may not take of its budget: what the streams cannot spare of it, all where short
    assert withheld(math.inf, BUDGET) == 0.0 and withheld(1.5 * BUDGET, BUDGET) == 0.0
    assert withheld(0.25 * BUDGET, BUDGET) == pytest.approx(0.75 * BUDGET)
    assert withheld(-0.01, BUDGET) > BUDGET  # already short: not even a prompt's room is left


class Req:
    """What AudioWindows reads of a request."""

    def __init__(self, rows: int, switched: bool) -> None:
        self.rid, self.sp = "r", SamplingParams(seed=1)
        self.audio = np.zeros((rows, 7), dtype="<i4")
        self.n_audio, self.n_chunks, self.first_window, self.switched = 0, 0, 0, switched
        self.t_first, self.sent_s = 0.0, 0.0
        self.held, self.grouped, self.state = [], [], {}


@pytest.mark.parametrize("mode", ["progressive", "reference"])
def test_the_rows_to_a_streams_next_chunk_are_those_after_which_its_next_window_leaves(program, mode):
    """`rows_to_next_send` against the windows themselves: add rows one at a time and count those
    until `after_row` sends a window, from every row of a stream's first 80 (progressive: while it
    sends tail windows, one each frame; reference: the regular windows)."""
    windows = AudioWindows(program, mode, StepClock(program.rows_per_second, 8), now=lambda: 1.0)
    req = Req(200, switched=False)
    predicted: dict[int, int] = {}
    sent_at: list[int] = []
    while req.n_audio < 120:
        if req.n_chunks > windows.clock_window:
            predicted[req.n_audio] = windows.rows_to_next_send(req)
        req.n_audio += 1
        out: list[DetokChunk] = []
        windows.after_row(req, out)
        if out:
            sent_at.append(req.n_audio)
    assert len(sent_at) > 5 and not req.switched  # a clock that measured nothing: tail windows only
    for n, rows in predicted.items():
        if n < 80:
            assert n + rows == next(s for s in sent_at if s > n), n


def engine(program, borrow: bool, in_hand_s: float, borrow_max: float = BORROW_MAX) -> Engine:
    """One stream playing with `in_hand_s` of audio in hand, a fitted step cost of 6 ms of decode,
    0.5 ms a prompt and 1.5 ms a group (a prompt a group: the budget leaves room for two), eleven
    prompts waiting; a borrowing step takes at most `borrow_max` budgets (`--lead-borrow-max`)."""
    eng = Engine(
        program,
        GpuWorkerSettings(
            max_batch_size=16, max_context=64, max_prefills=8, first_chunk="reference", lead_borrow=borrow,
            lead_borrow_max=borrow_max,
        ),
    )  # fmt: skip
    s = eng.scheduler
    s.real_time = True  # paced as on a GPU
    sampling = SamplingParams(max_tokens=len(ROWS) + 40, temperature=0.0)
    eng.add(Prompt(rid="playing", tokens=ROWS.tobytes(), n_rows=len(ROWS), sampling=sampling))
    eng.step()
    cost, rng = s.clock.cost, np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(0, 4))
        cost.add(int(rng.integers(1, 300)), int(rng.integers(0, 50_000)), n, 0.006 + 0.002 * n, n)
    req = s.running["playing"]
    req.n_chunks, req.t_first, req.sent_s = 1, eng.windows.now(), in_hand_s
    # 21 rows made, none in flight: its next window (rows 0..27) leaves after 7 more steps
    req.n_audio = req.n_gen = req.n_launched = 21
    assert eng.windows.rows_to_next_send(req) == 7
    for i in range(11):
        eng.add(Prompt(rid=f"r{i}", tokens=ROWS.tobytes(), n_rows=len(ROWS), sampling=sampling))
    return eng


def test_a_stream_well_ahead_lets_a_step_start_more_prompts_and_first_audio_is_promised_on_it(
    program, monkeypatch
):
    keep = engine(program, borrow=False, in_hand_s=1.0)
    monkeypatch.setattr(keep.runner, "prompt_groups", lambda rows: len(rows))  # a lane each
    keep.scheduler.admit(0, keep.runner.prompt_groups)
    assert keep.scheduler.admitted_last == 2  # (10.7 - 6) / (0.5 + 1.5) ms

    borrow = engine(program, borrow=True, in_hand_s=1.0)
    s = borrow.scheduler
    fit = s.prompt_room()
    assert fit.borrowed == pytest.approx((BORROW_MAX - 1) * s.step_budget())  # 1 s in hand: the most
    s.admit(0, lambda rows: len(rows))
    assert s.admitted_last == 7  # (2 x 10.7 - 6) / 2 ms
    assert s.admission_stops["room"] == 1
    assert borrow.metrics()["steps_borrowing_total"] == 1 and keep.metrics()["steps_borrowing_total"] == 0
    # prompts still wait: the next steps are expected to take the heavier step's time
    assert s.clock.rows_time_high(7) == pytest.approx(7 * (0.006 + 7 * 0.002), rel=0.01)

    wide = engine(program, borrow=True, in_hand_s=1.0, borrow_max=3.0).scheduler  # --lead-borrow-max 3
    assert wide.prompt_room().borrowed == pytest.approx(2 * wide.step_budget())
    wide.admit(0, lambda rows: len(rows))
    assert (
        wide.admitted_last == 8 and wide.admission_stops["cap"] == 1
    )  # (3 x 10.7 - 6) / 2 ms: 13, the cap 8


def test_a_step_past_its_budget_is_expected_heavy_though_no_prompt_waits(program):
    eng = engine(program, borrow=True, in_hand_s=1.0)
    s = eng.scheduler
    for _ in range(5):  # six prompts left: every one starts in this step
        s.waiting.pop()
    s.admit(0, lambda rows: len(rows))
    assert s.admitted_last == 6 and not s.waiting
    assert s.clock.rows_time_high(7) == pytest.approx(7 * (0.006 + 6 * 0.002), rel=0.01)
    s.admit(0, lambda rows: len(rows))  # nothing to start: no longer expected heavy
    assert s.clock.rows_time_high(7) < 7 * s.step_budget()


@pytest.mark.parametrize("in_hand_s, admitted", [(0.04, 1), (0.3, 7)])
def test_a_stream_that_just_started_playing_keeps_the_step_within_what_it_spares(
    program, in_hand_s, admitted, monkeypatch
):
    """Its next window 7 steps away, on a clock whose pessimistic pace is 1 ms a row, with the margin
    and the trip: 40 ms in hand spares 7 ms of a step, less than the budget (10.7 ms: the rest is
    withheld and the step starts its first prompt alone), and nothing to borrow (its other rows at
    a budget each); 300 ms in hand spares more than two budgets (the step borrows the most). The
    tap's step event names what ended the admission (room) and what the step withheld."""
    eng = engine(program, borrow=True, in_hand_s=in_hand_s)
    s = eng.scheduler
    t = eng.windows.now()
    eng.windows.now = lambda: t  # the listener's clock stands still: exactly `in_hand_s` in hand
    s.running["playing"].t_first = t
    s.clock.rows_time_high = lambda rows: 0.001 * rows
    fit = s.prompt_room()
    assert (fit.borrowed > 0) == (admitted > 2) and (fit.withheld > 0) == (admitted < 2)
    keep = (in_hand_s - 0.025 - 1.15 * 0.006) / 1.15
    assert fit.withheld == pytest.approx(max(0.0, s.step_budget() - keep))
    s.admit(0, lambda rows: len(rows))
    assert s.admitted_last == admitted
    assert eng.metrics()["steps_withholding_total"] == (admitted < 2)
    # the tap's step event says what ended the admission and what the step withheld
    published = []
    monkeypatch.setattr(stages, "tap_listening", lambda: True)
    monkeypatch.setattr(stages, "publish_stage", lambda rid, stage, t=None, **d: published.append(d))
    reporter = StageReporter()
    reporter.publish(eng)  # the listener arrives
    reporter.publish(eng)
    (event,) = published
    assert event["stop"] == "room" and event["waiting"] == 11 - admitted
    assert event["withheld_ms"] == pytest.approx(1000 * fit.withheld, abs=0.001)
    assert (event["withheld_ms"] > 0) == (admitted < 2)


def test_a_stream_whose_text_has_run_out_counts_with_the_step_it_resumes_after(program):
    eng = engine(program, borrow=True, in_hand_s=0.3)
    s = eng.scheduler
    req = s.running["playing"]
    before = s.prompt_room().borrowed
    req.input_open = True  # its text has run out: it resumes a step after more comes
    assert s.waits(req)
    assert 0 < s.prompt_room().borrowed <= before
    req.sent_s = 0.04
    assert s.prompt_room().borrowed == 0.0
    req.n_launched = req.budget - len(req.prompt)  # its last rows launched: no step delays it
    assert s.prompt_room().borrowed == pytest.approx((BORROW_MAX - 1) * s.step_budget())  # none plays


@pytest.mark.parametrize("mode", ["reference", "progressive"])
def test_a_chunk_the_step_in_flight_completes_counts_as_in_hand_and_the_next_one_waits(program, mode):
    """The step in flight makes row 28, which ends the next window (or frame): the step launched
    next delays only the chunk after it, and the listener has that window's audio (85 ms) by then."""
    windows = AudioWindows(program, mode, StepClock(program.rows_per_second, 8), now=lambda: 10.0)
    req = Req(200, switched=True)
    req.n_chunks, req.t_first, req.sent_s = 4, 10.0, 0.2
    req.n_audio = req.n_gen = 27
    req.n_launched = 27
    assert windows.spare(req, 10.0) == (pytest.approx(0.2), 1)
    req.n_launched = 28  # row 28's step in flight
    frame = 7 / program.rows_per_second
    assert windows.spare(req, 10.0) == (pytest.approx(0.2 + frame), 8)
    if mode == "progressive":  # still sending tail windows, on a clock that has measured no
        req.switched = False  # steps: row 28's frame does not switch it, the next frame is 7 on
        assert windows.spare(req, 10.0) == (pytest.approx(0.2 + frame), 8)


@pytest.mark.parametrize("in_hand_s, switches", [(0.0, False), (0.1, False), (0.25, True)])
def test_a_tail_window_in_flight_puts_the_next_chunk_off_only_where_it_switches(program, in_hand_s, switches):
    """Row 28's frame, in flight, goes out as a tail window. The stream switches to regular windows
    there only if the audio in hand then (the frame's included, the in-flight row's time at the
    pessimistic pace and margin taken off) covers the 21 rows until the next regular window at the
    step budget (10.7 ms a row, with the margin and the trip: 284 ms), though the steps run at 4 ms
    a row: its next chunk is then 22 rows away, else 8 (the next frame). A stream counted as
    switching where it cannot would seem short and hold every prompt but the first out of the
    step."""
    clock = StepClock(program.rows_per_second, 8)
    clock.rows_time_high = lambda rows: 0.004 * rows
    windows = AudioWindows(program, "progressive", clock, now=lambda: 10.0)
    req = tail_in_flight(in_hand_s)
    frame = 7 / program.rows_per_second
    assert windows.switches(21, in_hand_s + frame - 1.15 * 0.004) == switches
    assert windows.spare(req, 10.0) == (pytest.approx(in_hand_s + frame), 22 if switches else 8)
    allow = windows.step_allowances([(req, 0)])[1]
    assert withheld(allow, clock.budget) == 0.0  # either way it spares the step its whole budget


def tail_in_flight(in_hand_s: float) -> Req:
    """A stream sending tail windows, `in_hand_s` of audio in hand, row 28 (a frame's end) in flight."""
    req = Req(200, switched=False)
    req.n_chunks, req.t_first, req.sent_s = 4, 10.0, in_hand_s
    req.n_audio = req.n_gen = 27
    req.n_launched = 28
    return req


@pytest.mark.parametrize("row_ms", [4.0, 1000 * BUDGET, 12.0])
def test_a_switch_counted_for_a_tail_window_in_flight_withholds_nothing(program, row_ms):
    """Whatever the audio in hand (0 to 0.6 s) and the pace (light, the budget's own, slower), where
    the tail window in flight is taken to switch its stream, the stream spares the next step its
    whole budget: the switch is foreseen on the audio left when the frame leaves, not on what is in
    hand now."""
    clock = StepClock(program.rows_per_second, 8)
    clock.rows_time_high = lambda rows: row_ms / 1000 * rows
    windows = AudioWindows(program, "progressive", clock, now=lambda: 10.0)
    outcomes = set()
    for in_hand_ms in range(0, 600, 2):
        req = tail_in_flight(in_hand_ms / 1000)
        rows = windows.spare(req, 10.0)[1]
        outcomes.add(rows)
        if rows == 22:  # counted as switching after that frame
            allow = windows.step_allowances([(req, 0)])[1]
            assert withheld(allow, clock.budget) == 0.0, (in_hand_ms, 1000 * allow)
    assert outcomes == {8, 22}


@pytest.mark.parametrize("row_ms", [7.0, 1000 * BUDGET])
def test_a_stream_spares_a_whole_step_budget_from_its_switch_to_regular_windows(program, row_ms):
    """A row every 7 ms of a fake clock (or every step budget, 10.7 ms), at that pace: the stream
    sends tail windows until the audio in hand covers its wait for the next regular window at the
    budget, so from its switch on, the next step may take the whole budget (`withheld` keeps none of
    it). Switched at the pace alone (at 7 ms, after its third chunk), it would spare a step 8.2 ms."""
    now = [10.0]
    clock = StepClock(program.rows_per_second, 8)
    clock.rows_time_high = lambda rows: row_ms / 1000 * rows
    windows = AudioWindows(program, "progressive", clock, now=lambda: now[0])
    req = Req(400, switched=False)
    while not req.switched:  # tail windows
        req.n_audio += 1
        req.n_gen = req.n_launched = req.n_audio
        now[0] += row_ms / 1000
        windows.after_row(req, [])
    tails, allowances = req.n_chunks, []
    for _ in range(60):  # its regular windows from then on
        req.n_audio += 1
        req.n_gen = req.n_launched = req.n_audio
        now[0] += row_ms / 1000
        windows.after_row(req, [])
        allowances.append(windows.step_allowances([(req, 0)])[1])
    assert min(allowances) >= clock.budget, f"{1000 * min(allowances):.1f} ms"
    assert withheld(min(allowances), clock.budget) == 0.0
    assert req.n_chunks > tails > 3


def test_on_the_simulated_h200_a_burst_starts_sooner_with_every_stream_on_time():
    kw = dict(tokens=400, ramp_s=0.0, duration_s=3.0, gpu=H200_RATE, calibrate=True, startup=H200_FORWARD,
              prompts_a_step=10)  # fmt: skip
    base, lent = simulate(256, **kw), simulate(256, lead_borrow=True, **kw)
    assert base["on_time_share"] == lent["on_time_share"] == 1.0
    assert lent["ttfa_p99_ms"] < 0.9 * base["ttfa_p99_ms"]
    assert lent["ttfa_p50_ms"] <= base["ttfa_p50_ms"]
