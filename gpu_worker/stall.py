"""Where a step that stalls is: a watch thread that, once the worker's loop has been inside one
step for `after_s`, takes the loop thread's Python stack (`sys._current_frames`) and keeps it for the
slow-step line with how far into the step it was taken. A loop thread blocked in a call that lets
go of the GIL (a device wait, a lock, a system call) is caught in it, about `after_s` into the step;
one holding the GIL (a garbage collection, a long C call that keeps it) lets the watch run only
once it is done, so the stack is taken later and shows where the thread went on from there (and the
slow step's `cpu` and `gc` times say which). The watch wakes every `period_s`, only while a step
runs, and costs the loop a GIL hand-over each time.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

STALL_AFTER_S = 0.03
PERIOD_S = 0.01
FRAMES = 6  # innermost frames kept


class StallWatch:
    def __init__(self, after_s: float = STALL_AFTER_S, period_s: float = PERIOD_S) -> None:
        self.after_s, self.period_s = after_s, period_s
        self._loop = threading.get_ident()  # the thread whose steps are watched: its creator's
        self._began = 0.0  # perf_counter at the start of the step in progress, 0: none
        self._step = 0
        self._taken: tuple[int, str] = (-1, "")  # (step, its stack: innermost first)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """A step starts on the loop thread."""
        self._step += 1
        self._began = time.perf_counter()
        self._wake.set()

    def end(self) -> str:
        """The step is over: the stack taken during it and when ("dir/file:line function < …,
        31 ms into the step", innermost first; "" if it never ran `after_s`)."""
        self._began = 0.0
        step, stack = self._taken
        return stack if step == self._step else ""

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop:
            began, step = self._began, self._step
            if not began:
                self._wake.wait()  # no step: sleep until one begins
                self._wake.clear()
                continue
            if step != self._taken[0] and time.perf_counter() - began >= self.after_s:
                frame = sys._current_frames().get(self._loop)
                if frame is not None:
                    into = time.perf_counter() - began
                    # An import's machinery (`<frozen importlib._bootstrap>`) hides what imports
                    frames = [
                        f for f in traceback.extract_stack(frame) if not f.filename.startswith("<frozen")
                    ]
                    frames = reversed(frames[-FRAMES:])
                    stack = " < ".join(f"{_where(f.filename)}:{f.lineno} {f.name}" for f in frames)
                    self._taken = (step, f"{stack}, {1000 * into:.0f} ms into the step")
            time.sleep(self.period_s)


def _where(filename: str) -> str:
    """A source file as its folder and name (gpu_worker/engine.py)."""
    return "/".join(filename.replace("\\", "/").split("/")[-2:])
