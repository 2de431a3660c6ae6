"""Tap-only events of the gpu_worker: when a request was admitted (got a slot and KV pages), when its
first token was sampled, and one `step` event a step (its batch, its prompts and where its time
went). No wire message marks these, so the worker publishes them as `StageEvent`s, and only while
someone listens on its tap: otherwise `publish` is one flag check.

A step event (request id "") carries `step` (the engine's count of steps collected), `batch` (requests launched,
prompts among them `prompts`), `running` and `waiting` after it, `stop` (what ended its admission
with prompts left waiting: an `ADMISSION_STOPS` name, "" where none wait), and in ms: `withheld` (of
the step budget, for the playing streams' next chunks: `pacing.withheld`), `wall` (the engine's
call: `schedule` admission and layout, `launch`, `wait` for the step before it on the device, and
`process`, the rest: its results into windows and ends), `gpu` (the device time of the step it
collected, from its launch to its results; 0 without CUDA events) and `loop` (the worker's loop
since the last step event: receiving, the step, sending its message). A step that only collected
the one before it has batch 0. `voxpipe bench tap-stats` sums them up (`steps`).
"""

from __future__ import annotations

import time
from typing import Any

from common.ipc import publish_stage, tap_listening


class StageReporter:
    def __init__(self) -> None:
        self._active = False
        self._admitted: set[str] = set()  # running requests already reported as admitted
        self._first: set[str] = set()  # ... and as having their first token
        self._last = 0.0  # perf_counter at the last step event

    def publish(self, engine: Any) -> None:
        """After each step: events for requests admitted or given their first token since the
        last, and the step's own event."""
        if not tap_listening():
            self._active = False
            return
        running = engine.running  # rid → Request (admitted_at, n_gen)
        now = time.perf_counter()
        if not self._active:
            # A listener just arrived: what is already running happened before it, so only
            # requests admitted from now on get events.
            self._active = True
            self._admitted, self._first = set(running), set(running)
            self._last = now
            return
        for rid in running.keys() - self._admitted:
            req = running[rid]
            publish_stage(rid, "admitted", req.admitted_at, prompt_rows=len(req.prompt), slot=req.slot)
        for rid in running.keys() - self._first:
            if running[rid].n_gen > 0:
                publish_stage(rid, "first_token", None, step=engine.step_count)
                self._first.add(rid)
        self._admitted = set(running)
        self._first &= self._admitted
        self._step(engine, now)

    def _step(self, engine: Any, now: float) -> None:
        _, (_, _, batch, prompts), _ = engine.last_step
        s = engine.scheduler
        ms = engine.step_parts() | {"gpu": engine.runner.last_gpu_s, "loop": now - self._last}
        ms["withheld"] = min(s.last_withheld, 1.0)  # a stream already short withholds past the budget
        self._last = now
        publish_stage(
            "", "step", None, step=engine.step_count, batch=batch, prompts=prompts,
            running=len(engine.running), waiting=len(engine.waiting), stop=s.last_stop,
            **{f"{k}_ms": round(1000 * v, 3) for k, v in ms.items()},
        )  # fmt: skip
