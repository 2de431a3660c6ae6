"""Admission control: how many speech requests run at once, and what the others do meanwhile.

A request holds an *active stream* from admission until its handler ends (all its text segments).
Active streams are admitted up to the capacity of the gpu_workers; past that, requests wait here in
arrival order (a bounded FIFO, `--max-queue`, each for at most `--queue-timeout` seconds), and past
the bound they are refused at once with 503 and a `Retry-After` estimated from the queue and the
recent completion rate. So overload turns into a short, bounded wait or an explicit "come back in
N s", never into an unbounded backlog inside the workers.

Capacity: each gpu_worker reports in its heartbeat metrics `stream_capacity`, the concurrent
streams its engine measured it can keep real time; until it does, its max batch size
(`ProcStatus.capacity`). `--max-streams N` replaces the sum by hand (0 = measured). When no
gpu_worker has reported at all, nothing limits admission here and the credit flow alone holds
prompts (the gateway cannot know the capacity yet). Admission sits in front of the credit flow
(`common.pool`): an admitted request's prompt still goes to the gpu_worker with free slots.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.events import ClientGone

RATE_WINDOW_S = 30.0  # completions counted over this long for the Retry-After estimate
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 120
RETRY_AFTER_UNKNOWN_S = 2  # nothing completed recently: no rate to estimate from


@dataclass(frozen=True)
class Rejected:
    """A request refused by admission: the HTTP status, why (naming the setting), Retry-After."""

    status: int
    message: str
    retry_after_s: int
    reason: str  # queue_full | queue_timeout

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Admission:
    """Active streams up to `capacity()`, a FIFO of at most `max_queue` waiting, each waiting at
    most `queue_timeout_s`. `capacity()` returns None while unknown (no limit)."""

    def __init__(self, capacity: Callable[[], float | None], max_queue: int, queue_timeout_s: float) -> None:
        self._capacity = capacity
        self.max_queue = max(0, max_queue)
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._queued = 0  # futures in `_waiting` not yet done (admitted or given up)
        self._done: collections.deque[float] = collections.deque()  # monotonic times of releases
        self.rejected: collections.Counter[str] = collections.Counter()  # reason → requests

    @property
    def queue_length(self) -> int:
        """Requests waiting for a stream (kept as a count: a burst asks for it with each request)."""
        return self._queued

    def limit(self) -> int | None:
        """Streams that may be active now (None: no limit known); at least 1 once known."""
        cap = self._capacity()
        if cap is None:
            return None
        return max(1, math.floor(cap))

    def _has_room(self) -> bool:
        limit = self.limit()
        return limit is None or self.active < limit

    async def acquire(self, client_gone: Callable[[], bool] = lambda: False) -> Rejected | None:
        """None once admitted (call `release` when the request ends), else why not. Cancelling
        the caller (its client went away) leaves the queue at once."""
        self.pump()
        if self.queue_length == 0 and self._has_room():
            self.active += 1
            return None
        if self.queue_length >= self.max_queue:
            return self._reject(
                "queue_full",
                f"the server is at capacity ({self.active} streams) and {self.queue_length} requests "
                f"already wait (--max-queue {self.max_queue}); retry later, or raise --max-queue, "
                "--max-streams or add gpu_workers",
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._queued += 1
        deadline = time.monotonic() + self.queue_timeout_s
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(fut), min(left, 1.0))
                except asyncio.TimeoutError:
                    if client_gone():
                        raise ClientGone from None
        except BaseException:
            self._leave(fut)
            raise
        if fut.done() and not fut.cancelled():
            return None  # pump() counted it as active
        self._leave(fut)
        return self._reject(
            "queue_timeout",
            f"waited {self.queue_timeout_s:g} s for a free stream (--queue-timeout) with "
            f"{self.active} streams active; retry later, or raise --queue-timeout, --max-streams "
            "or add gpu_workers",
        )

    def release(self) -> None:
        self.active -= 1
        self._done.append(time.monotonic())
        self.pump()

    def pump(self) -> None:
        """Admit waiting requests, oldest first, while there is room (on each release, and
        periodically, since capacity grows when a gpu_worker reports)."""
        while self._waiting:
            if self._waiting[0].done():
                self._waiting.popleft()
                continue
            if not self._has_room():
                return
            self.active += 1
            self._queued -= 1
            self._waiting.popleft().set_result(None)

    def _leave(self, fut: asyncio.Future[None]) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # admitted in the same instant it gave up: hand the stream back
        elif fut.cancel():
            self._queued -= 1
        try:
            self._waiting.remove(fut)
        except ValueError:
            pass

    def _reject(self, reason: str, message: str) -> Rejected:
        self.rejected[reason] += 1
        return Rejected(503, message, self.retry_after_s(), reason)

    def completion_rate(self) -> float:
        """Requests finished per second over the last RATE_WINDOW_S."""
        now = time.monotonic()
        while self._done and now - self._done[0] > RATE_WINDOW_S:
            self._done.popleft()
        if not self._done:
            return 0.0
        return len(self._done) / max(1.0, min(RATE_WINDOW_S, now - self._done[0]))

    def retry_after_s(self) -> int:
        """Seconds until the queue ahead (and this request) should have drained at the recent
        completion rate."""
        rate = self.completion_rate()
        if rate <= 0:
            return RETRY_AFTER_UNKNOWN_S
        est = math.ceil((self.queue_length + 1) / rate)
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, est))
