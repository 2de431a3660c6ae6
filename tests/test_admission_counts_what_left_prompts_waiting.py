"""Each step that leaves prompts waiting counts what stopped its admission (the batch or slots
full, the cap on prompts or prompt rows a step, the fitted step cost's room, the runner's graphs,
the KV pages), and every prompt started is counted: /metrics exports both, so a burst's admission
rate says what bounds it."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.scheduler.scheduler import ADMISSION_STOPS
from gpu_worker.scheduler.step_cost import PromptRoom
from programs import get_spec, load_program_class

ROWS = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", lm_head="audio")
    p.load_lm()
    return p


def burst(program, n: int, **limits) -> Engine:
    eng = Engine(program, GpuWorkerSettings(**{"max_batch_size": 8, "max_context": 64, **limits}))
    for i in range(n):
        sampling = SamplingParams(max_tokens=len(ROWS) + 20, temperature=0.0)
        eng.add(Prompt(rid=f"r{i}", tokens=ROWS.tobytes(), n_rows=len(ROWS), sampling=sampling))
    return eng


def stops(eng: Engine) -> dict[str, int]:
    return {k: v for k, v in eng.scheduler.admission_stops.items() if v}


@pytest.mark.parametrize(
    "limits, n, first, why",
    [
        ({"max_prefills": 3}, 7, 3, "cap"),
        ({"max_prefill_rows": 2 * len(ROWS)}, 5, 2, "rows"),
        ({"max_batch_size": 2}, 5, 2, "batch"),
        ({"num_pages": 1 + 2 * 2}, 5, 2, "pages"),  # two requests' pages (2 a request) and the null page
    ],
)
def test_a_step_that_leaves_prompts_waiting_says_why(program, limits, n, first, why):
    eng = burst(program, n, **limits)
    eng.step()
    assert eng.scheduler.admitted_last == first
    assert stops(eng) == {why: 1}
    metrics = eng.metrics()
    assert metrics["prompts_started_total"] == first
    assert metrics[f"admission_stopped_by_{why}_total"] == 1
    assert {f"admission_stopped_by_{k}_total" for k in ADMISSION_STOPS} <= set(metrics)


def test_the_room_and_the_graphs_stop_a_step_after_its_first_prompt(program, monkeypatch):
    eng = burst(program, 4)
    no_room = PromptRoom(0.0, prompt=0.001)
    monkeypatch.setattr(eng.scheduler, "prompt_room", lambda: no_room)  # no room beside the streams
    eng.scheduler.admit(0)
    assert eng.scheduler.admitted_last == 1 and stops(eng) == {"room": 1}  # the first prompt always starts
    monkeypatch.undo()
    eng.scheduler.admit(0, lambda rows: 1 if len(rows) <= 2 else None)  # the graphs take two together
    assert eng.scheduler.admitted_last == 2 and stops(eng) == {"room": 1, "graphs": 1}
    eng.scheduler.admit(0)  # the last one: nothing left waiting, nothing counted
    assert eng.scheduler.admitted_last == 1 and stops(eng) == {"room": 1, "graphs": 1}
    assert eng.scheduler.prompts_started == 4


def test_a_burst_that_fits_counts_no_stop(program):
    eng = burst(program, 4)
    eng.step()
    assert eng.scheduler.admitted_last == 4 and stops(eng) == {}
    eng.run_until_idle()
    assert eng.metrics()["prompts_started_total"] == 4
