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

Then the urgent requests are decoded and sent first, on their own, and the rest after them: those
with a window whose listener has less audio left than a pass takes and the margin (`decode_s` and
MARGIN_S; no slack at all for a first chunk or a stream running late), so that a first chunk waits
for no gathered window and a window near its deadline waits for no window that could wait longer
(under Poisson arrivals, the second chunk of a stream whose first went out after one frame). A
request's end (`Finished`) goes out at once when none of its windows is waiting here, else right
after them.
"""

from __future__ import annotations

from collections.abc import Callable

from common.messages import DetokBatch, DetokChunk, Finished

# Transport to the gateway and the client, and jitter (10 ms left chunks a few ms late under load
# on the H200).
MARGIN_S = 0.020


def urgent_at(arrived_s: float, slack_s: float, decode_s: float, margin_s: float = MARGIN_S) -> float:
    """When a window that arrived at `arrived_s` with `slack_s` of its listener's audio left has no
    more left than a pass takes (`decode_s`) and the margin: its deadline, and from then on it is
    urgent (`is_urgent`)."""
    return arrived_s + slack_s - decode_s - margin_s


def is_urgent(slack_s: float, waited_s: float, decode_s: float, margin_s: float = MARGIN_S) -> bool:
    """Whether a window goes in a pass's urgent group: its listener had `slack_s` of audio left when
    it arrived (none: a first chunk, a stream running late) and has played `waited_s` of it since,
    leaving no more than a pass takes (`decode_s`) and the margin (`urgent_at`)."""
    return slack_s <= 0 or waited_s >= urgent_at(0.0, slack_s, decode_s, margin_s)


class Gather:
    def __init__(self, max_wait_s: float, full_batch: int) -> None:
        self.max_wait_s = max_wait_s
        self.full_batch = full_batch
        self.chunks: list[DetokChunk] = []
        self._arrived: list[float] = []  # when each of `chunks` reached this worker
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
            self.deadline = min(self.deadline, urgent_at(arrived, c.slack_ms / 1000, self.decode_s))
        self.chunks.extend(batch.chunks)
        self._arrived.extend([arrived] * len(batch.chunks))
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

    def take(self, now: float | None = None) -> tuple[list[DetokChunk], list[DetokChunk], list[Finished]]:
        """(windows of urgent requests, the other windows, the held ends), each in arrival order;
        `now` (the clock of `add`'s `arrived`): what the windows' listeners have played since they
        came counts against their slack (None: nothing yet)."""
        urgent = {
            c.rid
            for c, at in zip(self.chunks, self._arrived, strict=True)
            if is_urgent(c.slack_ms / 1000, 0.0 if now is None else now - at, self.decode_s)
        }
        first = [c for c in self.chunks if c.rid in urgent]
        rest = [c for c in self.chunks if c.rid not in urgent]
        out = first, rest, self.finished
        self.chunks, self._arrived, self.finished, self.deadline = [], [], [], float("inf")
        return out

    def take_where(self, takes: Callable[[DetokChunk], bool]) -> tuple[list[DetokChunk], list[Finished]]:
        """The waiting windows `takes` picks (the first chunks the codec's first lane decodes while
        a pass runs), in arrival order, and the held ends of the requests that have no window
        waiting after them; the rest keep waiting."""
        picked = [takes(c) for c in self.chunks]
        if not any(picked):
            return [], []
        out = [c for c, p in zip(self.chunks, picked, strict=True) if p]
        kept = [(c, at) for c, at, p in zip(self.chunks, self._arrived, picked, strict=True) if not p]
        self.chunks, self._arrived = [c for c, _ in kept], [at for _, at in kept]
        waiting = {c.rid for c in self.chunks}
        ends = [f for f in self.finished if f.rid not in waiting]
        self.finished = [f for f in self.finished if f.rid in waiting]
        # the deadline of the windows left, as `add` set it for them alone
        self.deadline = min(
            [at + self.max_wait_s for at in self._arrived[:1]]
            + [
                urgent_at(at, c.slack_ms / 1000, self.decode_s)
                for c, at in zip(self.chunks, self._arrived, strict=True)
            ],
            default=float("inf"),
        )
        return out, ends

    def decoded(self, seconds: float) -> None:
        """A decode call took `seconds`."""
        self.decode_s = max(seconds, 0.95 * self.decode_s)
