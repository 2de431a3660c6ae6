"""Tap-only stage events of the gpu_worker: when a request was admitted (got a slot and KV pages)
and when its first token was sampled. No wire message marks these, so the worker publishes them as
`StageEvent`s, and only while someone listens on its tap: otherwise `publish` is one flag check.
"""

from __future__ import annotations

from typing import Any

from common.ipc import publish_stage, tap_listening


class StageReporter:
    def __init__(self) -> None:
        self._active = False
        self._admitted: set[str] = set()  # running requests already reported as admitted
        self._first: set[str] = set()  # ... and as having their first token

    def publish(self, engine: Any) -> None:
        """After each step: events for requests admitted or given their first token since the last."""
        if not tap_listening():
            self._active = False
            return
        running = engine.running  # rid → Request (admitted_at, n_gen)
        if not self._active:
            # A listener just arrived: what is already running happened before it, so only
            # requests admitted from now on get events.
            self._active = True
            self._admitted, self._first = set(running), set(running)
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
