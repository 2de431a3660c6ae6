"""How late an event loop runs what is due: `LoopLag` wakes every `period_s` and measures how much
later than asked it woke.

The gateway's one event loop accepts every connection, parses every request, submits it and writes
every audio chunk of every stream. When that work outgrows the loop (a burst's requests all parsed
and submitted in turn, hundreds of streams' chunks), everything on it waits: a request's handler
starts late and a chunk leaves late, and the times the gateway stamps on a request (from its
handler's start) do not show it. The lag shows the loop's longest stretch of work without a turn
for its timers: `voxpipe_gateway_loop_lag_seconds` (each wake's delay) and
`voxpipe_gateway_loop_lag_max_seconds` (the largest over the last `window_s`). A queue of short
stretches (a burst's requests, read a batch of connections at a time with the timers run between)
shows only in part. A load bench's client processes watch their own loops the same way: a client
that reads its streams late adds its lag to the time to first audio it measures.
"""

from __future__ import annotations

import asyncio
import collections
import time

PERIOD_S = 0.02  # 50 wakes a second: a few microseconds of the loop each
WINDOW_S = 10.0


class LoopLag:
    def __init__(self, period_s: float = PERIOD_S, window_s: float = WINDOW_S, observe=None) -> None:
        self.period_s, self.window_s = period_s, window_s
        self.observe = observe  # called with each wake's delay (seconds): a histogram's observe
        # (time, delay) of the delays that are the largest since: the window's maximum at the front
        self._peaks: collections.deque[tuple[float, float]] = collections.deque()

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            asked = time.monotonic() + self.period_s
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            self.record(now, max(0.0, now - asked))

    def record(self, now: float, delay: float) -> None:
        if self.observe is not None:
            self.observe(delay)
        peaks = self._peaks
        while peaks and peaks[-1][1] <= delay:  # a later, larger delay outlives them in the window
            peaks.pop()
        peaks.append((now, delay))

    def max_s(self, now: float | None = None) -> float:
        """The largest delay over the last `window_s` seconds."""
        now = time.monotonic() if now is None else now
        peaks = self._peaks
        while peaks and now - peaks[0][0] > self.window_s:
            peaks.popleft()
        return peaks[0][1] if peaks else 0.0
