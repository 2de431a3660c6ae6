"""After its admission the scheduler tells its clock what the next steps may take
(`PromptRoom.expected`), and first audio is promised on that pace (`StepClock.rows_time_high`): a
step that borrows past its budget (`--lead-borrow`) at its fitted time, as much slower as the steps
served lately run, whether or not prompts still wait; else, while prompts wait, up to the budget.
The admission simulation (bench/admission_sim.py) tells its clock the same for the same room and
prompts, so that its first chunks are decided on the steps the engine would decide them on."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bench.admission_sim import new_worker
from gpu_worker.scheduler.step_cost import PromptRoom

BUDGET = 0.88 / 82.03  # a step budget: 0.88 of a 12.19 ms row


def test_the_steps_after_an_admission_are_expected_as_heavy_as_it():
    slow = 1.3
    # no room to bound (no stream runs, nothing fitted): the budget while prompts wait
    assert PromptRoom(math.inf).expected(0.0, True, BUDGET, slow) == BUDGET
    assert PromptRoom(math.inf).expected(0.0, False, BUDGET, slow) == 0.0
    fit = PromptRoom(0.004, prompt=0.0005, token=1e-5, group=0.001)
    # prompts wait: the budget less what the room leaves unspent, at most the budget
    assert fit.expected(0.003, True, BUDGET, slow) == pytest.approx(BUDGET - 0.001)
    assert fit.expected(0.006, True, BUDGET, slow) == pytest.approx(BUDGET)
    assert fit.expected(0.003, False, BUDGET, slow) == 0.0  # none waits: as the steps go
    lent = dataclasses.replace(fit, borrowed=0.008)
    # a step that may borrow: its fitted time as much slower as the steps run, past the budget
    assert lent.expected(0.010, True, BUDGET, slow) == pytest.approx(slow * (BUDGET + 0.006))
    # past its room, the step in flight is as heavy though every prompt started
    assert lent.expected(0.010, False, BUDGET, slow) == pytest.approx(slow * (BUDGET + 0.006))
    assert lent.expected(0.003, False, BUDGET, slow) == 0.0  # within its room, none waiting


def fitted_worker(lead_borrow: bool):
    """A simulated worker whose step cost is fitted (6 ms a step and 2 ms a prompt) and one stream
    playing a second ahead of its listener."""
    w = new_worker(lead_borrow=lead_borrow, prompts_a_step=16)
    cost, rng = w.clock.cost, np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(0, 4))
        cost.add(int(rng.integers(1, 300)), int(rng.integers(0, 50_000)), n, 0.006 + 0.002 * n, n)
    w.now = 10.0
    run = {0: dict(sent=0.0, gen=21, first=9.0, sent_audio=2.0, late=0.0)}
    return w, run


@pytest.mark.parametrize("lead_borrow", [False, True])
def test_the_simulation_expects_what_the_scheduler_would(lead_borrow):
    w, run = fitted_worker(lead_borrow)
    k = w.prompts_next(run, waiting=11)
    fit = w.fitted
    assert fit is not None and (fit.borrowed > 0) == lead_borrow
    assert k == (7 if lead_borrow else 2)  # (2 x 10.7 - 6) / 2 ms, (10.7 - 6) / 2 ms
    groups = [w.gpu.groups(i + 1) - w.gpu.groups(i) for i in range(1, k)]
    spent = fit.cost(w.prompt_len, 1) + sum(fit.cost(w.prompt_len, g) for g in groups)
    expected = w.expected(k, True)
    assert expected == fit.expected(spent, True, w.clock.budget, w.clock.slowness())
    if lead_borrow:  # the borrowing step's time: heavier than the budget the prompts wait on
        assert expected > w.clock.budget
    else:
        assert expected <= w.clock.budget
    # the same step with no prompt left waiting: heavy only where it ran past its room
    assert (w.expected(k, False) > 0) == (lead_borrow and spent > fit.room)
    # one prompt waiting: the step borrows nothing (the first starts anyway)
    w.prompts_next(run, waiting=1)
    assert w.fitted.borrowed == 0.0
