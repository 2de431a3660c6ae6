"""The engine asks `AudioWindows.after_row` for a window only at rows whose count is in `due`
(mod the stride): every chunk a stream gets is the same as when it asks at every row, for every
first-chunk mode and pace, Orpheus and CSM alike."""

from __future__ import annotations

import numpy as np
import pytest

from common.messages import SamplingParams
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.request import Request
from gpu_worker.windows import AudioWindows
from programs import get_spec, load_program_class

CASES = [("orpheus-tiny", m) for m in ("reference", "adaptive", "fastest", "progressive")] + [
    ("csm-tiny", m) for m in ("reference", "adaptive", "fastest")
]


def stream(program, mode: str, step_s: float, every_row: bool) -> list:
    clock = StepClock(program.rows_per_second, 16)
    for _ in range(200):
        clock.record(8, step_s)
    now = [0.0]
    windows = AudioWindows(program, mode, clock, now=lambda: now[0])
    c = program.n_codebooks
    req = Request("r", np.zeros((4, c), np.int64), SamplingParams(seed=5), 0.0, 300)
    req.audio = np.arange(400 * c, dtype="<i4").reshape(400, c) % 97
    chunks = []
    for n in range(1, 300):
        now[0] += step_s
        req.n_audio = n
        if every_row or n % windows.stride in windows.due:
            out = []
            windows.after_row(req, out)
            chunks += [(n, chunk) for chunk in out]
    return chunks


@pytest.mark.parametrize("model, mode", CASES)
def test_windows_end_only_at_due_rows(model, mode):
    program = load_program_class(model)(get_spec(model), load_format="dummy")
    for step_s in (0.003, 0.008, 0.013):  # ahead of real time, near it, behind it
        every = stream(program, mode, step_s, every_row=True)
        assert len(every) > 10
        assert stream(program, mode, step_s, every_row=False) == every, step_s
