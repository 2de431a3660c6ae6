"""The dispatcher's runs (a one-at-a-time worker handed several messages where more wait than workers
are free) take each free worker's share of the live waiting messages, at most `burst`: counted only
as far as that, since the pump runs for every message of a burst's long queue."""

from __future__ import annotations

import collections

import pytest
import zmq.asyncio

from common.pool import AsyncDispatchChannel


class Fut:
    """A waiting message's future that counts how often it is asked whether it is done."""

    asked = 0

    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        Fut.asked += 1
        return self._done


@pytest.fixture
def dispatcher():
    """Two free one-at-a-time workers, runs of at most 4, the messages waiting (done or not)."""
    ctx = zmq.asyncio.Context()
    made: list[AsyncDispatchChannel] = []

    def make(waiting: list[bool]) -> AsyncDispatchChannel:
        d = AsyncDispatchChannel(f"inproc://runs{len(made)}", ctx=ctx, burst=4)
        d._free = collections.OrderedDict([(b"a", "a"), (b"b", "b")])
        d._waiting = collections.deque((b"", Fut(done)) for done in waiting)
        made.append(d)
        return d

    yield make
    for d in made:
        d._sock.close(linger=0)
    ctx.term()


def test_a_long_queue_gives_each_free_worker_a_full_run_without_being_counted_through(dispatcher):
    d = dispatcher([False] * 1000)
    Fut.asked = 0
    assert d._runs() == {b"a": 4, b"b": 4}
    assert Fut.asked == 8  # two workers' runs of four: no more of the 1000 looked at


def test_a_short_queue_shares_its_live_messages(dispatcher):
    d = dispatcher([False, True, False, True, False, False, True])  # 4 live, 3 already taken
    assert d._runs() == {b"a": 2, b"b": 2}
    d = dispatcher([False, True, True])  # 1 live: no run
    assert d._runs() == {}
