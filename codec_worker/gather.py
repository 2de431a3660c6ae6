"""When the codec worker decodes: gather windows from several steps into one batch while every
waiting window's listener still has audio to play.

A codec call has a fixed cost (a SNAC graph replay is ~1 ms at batch 1 on the H200) besides its
per-window cost, and its batch is padded up to a graph bucket. Decoding each LM step's few dozen
windows on arrival pays both about a hundred times a second, on the GPU the LM needs. Each
DetokChunk says how long its listener can wait (`slack_ms`, stamped by the gpu_worker: audio
already sent minus audio already played; 0 for a first chunk). Windows wait here until

- the earliest deadline (arrival + slack - the time a decode takes - a margin) comes,
- `max_wait_s` has passed since the oldest one arrived,
- a full batch is waiting, or
- a request finished (its end goes out after its last audio, without delay).

First chunks and any late stream (slack 0) go at once, so this never adds to the time to first
audio.
"""

from __future__ import annotations

from common.messages import DetokBatch, DetokChunk, Finished

MARGIN_S = 0.010  # transport to the gateway and the client, and jitter


class Gather:
    def __init__(self, max_wait_s: float, full_batch: int) -> None:
        self.max_wait_s = max_wait_s
        self.full_batch = full_batch
        self.chunks: list[DetokChunk] = []
        self.finished: list[Finished] = []
        self.deadline = float("inf")
        self.decode_s = 0.0  # running average of one decode call, which the deadlines leave room for

    def add(self, batch: DetokBatch, now: float) -> None:
        if not self.chunks and not self.finished:
            self.deadline = now + self.max_wait_s
        for c in batch.chunks:
            self.deadline = min(self.deadline, now + c.slack_ms / 1000 - self.decode_s - MARGIN_S)
        self.chunks.extend(batch.chunks)
        if batch.finished:
            self.finished.extend(batch.finished)
            self.deadline = now

    def due(self, now: float) -> bool:
        """Decode now?"""
        return bool(self.chunks or self.finished) and (
            now >= self.deadline or len(self.chunks) >= self.full_batch
        )

    def wait_ms(self, now: float, idle_ms: int = 100) -> int:
        """How long the worker may block for more input before something is due."""
        if not self.chunks and not self.finished:
            return idle_ms
        return max(0, min(idle_ms, int((self.deadline - now) * 1000) + 1))

    def take(self) -> tuple[list[DetokChunk], list[Finished]]:
        out = self.chunks, self.finished
        self.chunks, self.finished, self.deadline = [], [], float("inf")
        return out

    def decoded(self, seconds: float) -> None:
        """A decode call took `seconds`: later deadlines leave room for one like it."""
        self.decode_s = seconds if self.decode_s == 0.0 else self.decode_s + 0.2 * (seconds - self.decode_s)
