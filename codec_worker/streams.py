"""Codec slots of a program with codec streams (programs/base.py, "Codec streams"): which slot
holds each request's codec state, the order its chunks may decode in, and which of a request's
waiting chunks decode together as one merged window (`rounds`).

A request's chunk 0 takes a free slot and starts its stream there (fresh); its later chunks
continue in that slot. The request's end (its `Finished`, forwarded after its chunks) frees the
slot. A stream whose gpu_worker died never ends: when no slot is free, the one unused longest is
taken back if it has been idle longer than `idle_s`; else the new request fails (503). A later
chunk of a request without a slot (a restarted codec worker, a slot taken back) cannot be
decoded: its state is gone, and the request fails (500).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from common.messages import DetokChunk

# A live stream sends a chunk every few frames; one silent this long has lost its gpu_worker.
IDLE_S = 60.0


class StreamError(Exception):
    """A chunk that cannot be decoded as its stream: `status` is the HTTP status its request ends
    with (503: no slot free, 500: the stream's state is gone)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Slots:
    """Slots 0..n-1 for requests; the program's scratch slot (n) is not among them."""

    def __init__(self, n: int, idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if n < 1:
            raise ValueError(f"codec streams need at least one slot, got {n}")
        self.n, self.idle_s, self.clock = n, idle_s, clock
        self.free = list(range(n - 1, -1, -1))  # popped from the end: slot 0 first
        # rid → slot, least recently used first (a use moves it to the end).
        self.owner: OrderedDict[str, int] = OrderedDict()
        self.used: dict[str, float] = {}  # rid → when its slot last decoded

    @property
    def scratch(self) -> int:
        """The slot padding entries decode in."""
        return self.n

    def take(self, chunk: DetokChunk) -> tuple[int, bool]:
        """The slot `chunk` decodes in and whether it starts the stream there; StreamError when it
        cannot be decoded."""
        now = self.clock()
        rid = chunk.rid
        if chunk.index == 0:
            if rid in self.owner:  # a request id used again: a new stream
                self.release(rid)
            slot = self._free_slot(rid, now)
            self.owner[rid] = slot
            self.used[rid] = now
            return slot, True
        slot = self.owner.get(rid)
        if slot is None:
            raise StreamError(
                f"codec stream lost: chunk {chunk.index} of {rid} has no codec state (the codec worker "
                "restarted, or the stream sat idle and its slot went to another request)",
                500,
            )
        self.owner.move_to_end(rid)
        self.used[rid] = now
        return slot, False

    def _free_slot(self, rid: str, now: float) -> int:
        if self.free:
            return self.free.pop()
        oldest = next(iter(self.owner))
        idle = now - self.used[oldest]
        if idle <= self.idle_s:
            raise StreamError(
                f"codec busy: all {self.n} codec streams are in use (--codec-streams); try again shortly",
                503,
            )
        slot = self.owner.pop(oldest)
        del self.used[oldest]
        return slot

    def release(self, rid: str) -> None:
        """The request ended: its slot is free again (nothing when it has none)."""
        slot = self.owner.pop(rid, None)
        if slot is not None:
            del self.used[rid]
            self.free.append(slot)


def rounds(
    chunks: list[DetokChunk], where: list[int], merge: tuple[int, ...] = (), mergeable=None
) -> list[list[list[int]]]:
    """Positions `where` of `chunks` in decode rounds of units: each request's waiting chunks in
    index order as units, a lone chunk or m consecutive chunks (m in `merge`, the largest that fits
    first; only chunks for which `mergeable(i)` holds) that decode as one window of m windows' rows
    (programs/base.py: `codec_merge`) and belong to one window group, if any; round k holds each
    request's k-th unit, so a request's chunks decode in order and never two of its units in one
    call. A window group arrives whole, so it splits into the same units whatever else waits."""
    by_rid: dict[str, list[int]] = {}
    for i in where:
        by_rid.setdefault(chunks[i].rid, []).append(i)
    sizes = sorted((m for m in merge if m > 1), reverse=True)
    out: list[list[list[int]]] = []
    for run in by_rid.values():
        run.sort(key=lambda i: chunks[i].index)
        k = n = 0
        while k < len(run):
            m = next((m for m in sizes if _joinable(chunks, run[k : k + m], m, mergeable)), 1)
            if n == len(out):
                out.append([])
            out[n].append(run[k : k + m])
            k, n = k + m, n + 1
    return [sorted(r) for r in out]


def _joinable(chunks: list[DetokChunk], run: list[int], m: int, mergeable) -> bool:
    """Whether `run` holds m chunks of consecutive indices, of one window group (or none), that
    may decode as one window."""
    if len(run) < m or (mergeable is not None and not all(mergeable(i) for i in run)):
        return False
    first, group = chunks[run[0]].index, chunks[run[0]].group
    return all(chunks[i].index == first + k and chunks[i].group == group for k, i in enumerate(run))
