"""Host → device copies that neither wait for the device nor allocate pinned memory on the way.

A copy from pageable memory first waits for everything queued on the stream (the host would lose
its lead over the device), so small host arrays go through pinned memory. `tensor.pin_memory()`
takes a block from torch's caching host allocator, which calls `cudaHostAlloc` (a system call that
pins and maps pages) whenever more blocks of a size are in use at once than ever before: the first
step that admits more prompts together than any before it, or runs a larger batch. `PinnedRing` is
one pinned buffer allocated at startup and used round-robin: `stage` writes a host array into its
next span (`take`: a span to copy into), and `fence` records an event after the copies (or
plans) that read the spans staged since the last fence; a span is written again only once its
event has passed (a wait only where the ring went round within the copies' time on the device,
which a ring many steps' staging long never does).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # common imports no torch when imported: each function does, as it runs
    import torch

ALIGN = 256  # bytes: a span's start, for the copy engine's alignment
RING_BYTES = 8 << 20  # one ring a process: ~170 admissions of 12 k-token histories before it wraps


class PinnedRing:
    """`nbytes` of pinned memory (pageable with `pinned` False, for a test on a CPU), spans fenced by
    `event()`s (torch.cuda.Event)."""

    def __init__(self, nbytes: int = RING_BYTES, pinned: bool = True, event=None) -> None:
        import torch

        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.event = event or torch.cuda.Event
        self.head = 0
        self._open: list[tuple[int, int]] = []  # spans staged since the last fence
        # (start, end, event) of fenced spans whose copies may not have run, in ring order
        self._pending: collections.deque = collections.deque()
        self.waits = 0  # stagings that had to wait for a span's copies (the ring went round)

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into the ring's next span, as a pinned tensor of its shape and dtype: read it
        only by work queued before the next `fence`. A tensor larger than the ring gets pinned
        memory of its own."""
        t = t.contiguous()
        out = self.take(t.shape, t.dtype)
        out.copy_(t)
        return out

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The ring's next span as an uninitialized pinned tensor (for a device → host copy queued
        before the next `fence`, say: its event marks the copy done)."""
        import torch

        n = math.prod(shape) * dtype.itemsize
        size = -(-n // ALIGN) * ALIGN
        if size > self.buf.numel():
            return torch.empty(shape, dtype=dtype, pin_memory=self.buf.is_pinned())
        if self.head + size > self.buf.numel():
            self.head = 0
        start, end = self.head, self.head + size
        self._reclaim(start, end)
        self.head = end
        self._open.append((start, end))
        return self.buf[start : start + n].view(dtype).view(shape)

    def fence(self) -> None:
        """The work that reads the spans staged since the last fence is queued (on the current
        stream): their event, recorded now, frees them."""
        if not self._open:
            return
        event = self.event()
        event.record()
        for start, end in self._open:
            self._pending.append((start, end, event))
        self._open = []

    def _reclaim(self, start: int, end: int) -> None:
        """Drop the pending spans whose copies have run; wait for those [start, end) overlaps."""
        pending = self._pending
        while pending:
            s, e, event = pending[0]
            if s < end and start < e:  # overlaps: its copies must have run before it is written
                if not event.query():
                    self.waits += 1
                    event.synchronize()
            elif not event.query():
                # Kept, and those after it: the spans the ring reaches next are the oldest, so the
                # first that [start, end) overlaps is at the front (whatever stream fenced each).
                break
            pending.popleft()
        # A span staged but not yet fenced is never handed out twice: the ring is far larger than
        # what one step stages.
        if any(s < end and start < e for s, e in self._open):
            raise RuntimeError("the pinned ring went round within one step's staging")


_RINGS: dict[str, PinnedRing] = {}


def ring(name: str = "in") -> PinnedRing:
    """This process's ring `name` (allocated at its first use: call it at startup to keep it
    there): "in" for host → device copies, "out" for the steps' results (device → host), each read
    on the host within a few steps of its copy, where the ring takes over a hundred steps' results
    to go round (RING_BYTES over a batch of 512's rows)."""
    if name not in _RINGS:
        _RINGS[name] = PinnedRing()
    return _RINGS[name]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` by a copy queued on the current stream, without waiting for the stream; on a
    CPU `t` itself."""
    import torch

    if torch.device(device).type != "cuda":
        return t
    r = ring()
    out = r.stage(t).to(device, non_blocking=True)
    r.fence()
    return out
