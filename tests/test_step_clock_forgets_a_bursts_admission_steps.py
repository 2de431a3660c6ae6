"""`StepClock` with `forget_admission` (--forget-admission-steps): once no prompt waits, how long the
next steps may take (`rows_time_high`, which first chunks and the switch to regular windows are
decided by) comes from the steps launched since a burst's admission alone, once there are a few;
while prompts wait, and without the setting, every recent step counts."""

from __future__ import annotations

import pytest

from gpu_worker.scheduler.pacing import LIGHT_MIN, StepClock

HEAVY_S, LIGHT_S = 0.030, 0.006


def clock(forget: bool, light: int, waiting: bool = False) -> StepClock:
    c = StepClock(82.03, 64, forget_admission=forget)
    c.expect(0.011)  # prompts wait: the burst's admission steps
    for _ in range(10):
        c.record(32, HEAVY_S, admitting=True)
    c.expect(0.0)  # the last prompt started
    for i in range(light):
        c.record(32, LIGHT_S + 0.0001 * i)
    if waiting:
        c.expect(0.011)
    return c


def test_the_steps_since_the_admission_decide_once_there_are_a_few():
    forgetting = clock(True, LIGHT_MIN)
    assert forgetting.rows_time_high(7) == pytest.approx(7 * (LIGHT_S + 0.0001 * (LIGHT_MIN - 1)))
    weighing_all = clock(False, LIGHT_MIN)
    assert weighing_all.rows_time_high(7) > 2 * forgetting.rows_time_high(7)


def test_with_enough_light_steps_their_own_spans_count():
    c = clock(True, 40)
    assert 7 * LIGHT_S <= c.rows_time_high(7) <= 7 * (LIGHT_S + 0.0001 * 40)


def test_too_few_light_steps_or_prompts_waiting_weigh_every_step():
    few = clock(True, LIGHT_MIN - 1)
    assert few.rows_time_high(7) == clock(False, LIGHT_MIN - 1).rows_time_high(7)
    waiting = clock(True, 20, waiting=True)
    assert waiting.rows_time_high(7) == clock(False, 20, waiting=True).rows_time_high(7) >= 7 * 0.011


def test_tick_marks_the_steps_launched_while_prompts_wait():
    c = StepClock(82.03, 64, forget_admission=True)
    c.tick(0)
    c.expect(0.011)
    for _ in range(6):
        c.tick(32)
    c.expect(0.0)
    for _ in range(8):
        c.tick(32)
    marks = list(c._admitting)
    # each interval is the step launched two calls before it (`tick`), marked as launched
    assert marks[:5] == [True] * 5 and marks[-6:] == [False] * 6


def test_prompts_waiting_again_weigh_every_step_at_once():
    c = clock(True, 20)
    light = c.rows_time_high(7)  # no prompt waits: the light steps alone
    c.expect(0.011)  # a new burst's prompts wait: no step recorded since
    assert c.rows_time_high(7) == clock(False, 20, waiting=True).rows_time_high(7) > max(light, 7 * 0.011)
