"""`within(aw, seconds)`: await `aw` for at most `seconds`, raising TimeoutError past them.

The gateway awaits with a time limit several times for every request and twice for every audio
chunk (its next event, its write). `asyncio.wait_for` in Python 3.11 wraps the awaitable in a task
of its own: a task created, scheduled and run through the event loop even when the result is
already there (a chunk queued, a write that needs no drain). `asyncio.timeout` (3.11+) arms a timer
on the calling task instead, so an awaitable that is ready completes without a trip through the
loop. On Python 3.10 it is `wait_for`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def within(aw: Awaitable[T], seconds: float) -> T:
        return await asyncio.wait_for(aw, seconds)
