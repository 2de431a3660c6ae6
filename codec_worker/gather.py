"""When the codec worker decodes: gather windows from several steps into one batch while every
waiting window's listener still has audio to play.

A codec call has a fixed cost (a graph replay of a 24 kHz codec is ~1 ms at batch 1 on the H200) besides its
per-window cost, and its batch is padded up to a graph bucket. Decoding each LM step's few dozen
windows on arrival pays both about a hundred times a second, on the GPU the LM needs. Each
DetokChunk says how long its listener can wait (`slack_ms`, stamped by the gpu_worker: audio
already sent minus audio already played; 0 for a first chunk or a stream running late). Windows
wait here until

- the earliest deadline (arrival + slack - the time a decode takes - a margin) comes,
- `max_wait_s` has passed since the first of them arrived, or
- a full batch is waiting.

Then the urgent requests (any window with no slack) are decoded and sent first, on their own, and
the rest after them: a first chunk waits for no gathered window. A request's end (`Finished`)
goes out at once when none of its windows is waiting here, else right after them.

A pass is bounded in time (`pass_s`, `--codec-pass-ms`): a first chunk that arrives while a pass
runs waits for all of it, and a pass of merged windows of hundreds of streams takes a large share
of a second. The windows beyond what a pass of `pass_s` decodes (at the seconds per row measured
on earlier passes) stay here, due at once, and go in the next pass, behind whatever urgent
windows came meanwhile. A request's windows leave in their order (a prefix of the arrivals), and
at least one full call of rows goes in every pass, so that small passes cannot make the measured
cost per row, and with it the next budget, ever worse.
"""

from __future__ import annotations

from common.messages import DetokBatch, DetokChunk, Finished

# Transport to the gateway and the client, and jitter (10 ms left chunks a few ms late under load
# on the H200).
MARGIN_S = 0.020


class Gather:
    def __init__(
        self, max_wait_s: float, full_batch: int, pass_s: float = 0.0, row_bytes: int = 0, min_rows: int = 0
    ) -> None:
        """`pass_s` > 0 bounds a pass (above); `row_bytes`: a window row's size on the wire (its
        tokens); `min_rows`: rows every pass may take whatever the budget (one full call)."""
        self.max_wait_s = max_wait_s
        self.full_batch = full_batch
        self.pass_s = pass_s if row_bytes > 0 else 0.0
        self.row_bytes = row_bytes
        self.min_rows = min_rows
        self.row_s = 0.0  # measured seconds a pass takes per row it decodes (passes of min_rows or more)
        self.chunks: list[DetokChunk] = []
        self.finished: list[Finished] = []  # ends of requests with windows waiting here
        self.deadline = float("inf")
        # A slowly forgotten maximum of recent decode calls: the deadlines leave room for a large
        # call even when small ones (a first chunk alone) came in between.
        self.decode_s = 0.0

    def add(self, batch: DetokBatch, arrived: float) -> list[Finished]:
        """Take a step's windows and ends; `arrived`: when the message reached this worker at the
        earliest. → the ends that may go at once (no window of theirs is waiting)."""
        if batch.chunks and not self.chunks:
            self.deadline = arrived + self.max_wait_s
        for c in batch.chunks:
            self.deadline = min(self.deadline, arrived + c.slack_ms / 1000 - self.decode_s - MARGIN_S)
        self.chunks.extend(batch.chunks)
        if not batch.finished:
            return []
        waiting = {c.rid for c in self.chunks}
        self.finished.extend(f for f in batch.finished if f.rid in waiting)
        return [f for f in batch.finished if f.rid not in waiting]

    def due(self, now: float) -> bool:
        """Decode now?"""
        return bool(self.chunks) and (now >= self.deadline or len(self.chunks) >= self.full_batch)

    def wait_ms(self, now: float, idle_ms: int = 100) -> int:
        """How long the worker may block for more input before something is due."""
        if not self.chunks:
            return idle_ms
        return max(0, min(idle_ms, int((self.deadline - now) * 1000) + 1))

    def rows(self, chunks: list[DetokChunk]) -> int:
        return sum(len(c.tokens) for c in chunks) // self.row_bytes if self.row_bytes else 0

    def take(self) -> tuple[list[DetokChunk], list[DetokChunk], list[Finished]]:
        """(windows of urgent requests, the other windows, the ends held with them), each in
        arrival order; what a bounded pass leaves stays, due at once, with its requests' ends."""
        urgent = {c.rid for c in self.chunks if c.slack_ms <= 0}
        first = [c for c in self.chunks if c.rid in urgent]
        rest = [c for c in self.chunks if c.rid not in urgent]
        left: list[DetokChunk] = []
        if self.pass_s > 0 and self.row_s > 0 and rest:
            budget = max(self.pass_s / self.row_s - self.rows(first), self.min_rows)
            rows = n = 0
            while n < len(rest) and (n == 0 or rows + len(rest[n].tokens) // self.row_bytes <= budget):
                rows += len(rest[n].tokens) // self.row_bytes
                n += 1
            rest, left = rest[:n], rest[n:]
        waiting = {c.rid for c in left}
        ends = [f for f in self.finished if f.rid not in waiting]
        self.finished = [f for f in self.finished if f.rid in waiting]
        self.chunks = left
        self.deadline = float("-inf") if left else float("inf")
        return first, rest, ends

    def decoded(self, seconds: float, rows: int = 0) -> None:
        """A decode pass of `rows` rows took `seconds`."""
        self.decode_s = max(seconds, 0.95 * self.decode_s)
        if rows >= max(self.min_rows, 1):
            per = seconds / rows
            self.row_s = per if self.row_s == 0 else 0.8 * self.row_s + 0.2 * per
