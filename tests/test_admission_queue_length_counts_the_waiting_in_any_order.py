"""The admission queue's length is a count kept as requests queue, are admitted, time out and leave
(`gateway/admission.py`, so that a request in a burst does not walk the queue ahead of it): it stays
equal to the requests still waiting whatever order they go in."""

from __future__ import annotations

import asyncio

from gateway.admission import Admission


def waiting(adm: Admission) -> int:
    return sum(not f.done() for f in adm._waiting)


async def test_the_count_follows_admissions_timeouts_and_cancellations():
    cap = [1.0]
    adm = Admission(lambda: cap[0], max_queue=100, queue_timeout_s=0.3)
    assert await adm.acquire() is None and adm.active == 1 and adm.queue_length == 0
    tasks = [asyncio.create_task(adm.acquire()) for _ in range(6)]
    await asyncio.sleep(0.01)
    assert adm.queue_length == waiting(adm) == 6
    tasks[2].cancel()  # its client went away
    await asyncio.sleep(0.01)
    assert adm.queue_length == waiting(adm) == 5
    adm.release()  # the oldest waiting one starts
    assert await tasks[0] is None
    assert adm.queue_length == waiting(adm) == 4 and adm.active == 1
    cap[0] = 3.0  # capacity grows: the next two start at the next pump
    adm.pump()
    assert await tasks[1] is None and await tasks[3] is None
    assert adm.queue_length == waiting(adm) == 2 and adm.active == 3
    left = await asyncio.gather(tasks[4], tasks[5])  # the rest wait out --queue-timeout
    assert all(r is not None and r.reason == "queue_timeout" for r in left)
    assert adm.queue_length == waiting(adm) == 0 and adm.active == 3
    for _ in range(3):
        adm.release()
    assert adm.active == 0 and await adm.acquire() is None
