"""The gateway's event-loop lag (common/loop_lag.py): a loop kept busy shows its delay in the lag
and in its window's maximum, which forgets it once the window has passed; a served gateway exports
both on /metrics."""

from __future__ import annotations

import asyncio
import time

from common.loop_lag import LoopLag
from tests.test_admission_queues_then_refuses_with_retry_after import make_rig  # noqa: F401


async def test_a_blocked_loop_shows_as_lag_for_the_window_then_not():
    seen: list[float] = []
    lag = LoopLag(period_s=0.01, window_s=0.5, observe=seen.append)
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.1)
        assert max(seen) < 0.1 and lag.max_s() < 0.1  # an idle loop
        time.sleep(0.25)  # the loop's own work: nothing else runs meanwhile
        await asyncio.sleep(0.05)
        assert max(seen) >= 0.2 and lag.max_s() >= 0.2, (max(seen), lag.max_s())
        await asyncio.sleep(0.6)  # past the window
        assert lag.max_s() < 0.1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_window_keeps_its_largest_delay_until_it_has_passed():
    lag = LoopLag(window_s=10.0)
    for t, d in [(0.0, 0.001), (1.0, 0.3), (2.0, 0.002), (3.0, 0.1), (4.0, 0.001)]:
        lag.record(t, d)
    assert lag.max_s(4.0) == 0.3
    assert lag.max_s(11.5) == 0.1  # the 0.3 at 1.0 is out; the 0.1 at 3.0 is not
    assert lag.max_s(13.5) == 0.001
    assert lag.max_s(20.0) == 0.0


async def test_a_served_gateway_exports_its_loop_lag(make_rig):  # noqa: F811
    rig = await make_rig()
    await asyncio.sleep(0.1)
    time.sleep(0.15)  # hold the gateway's loop (the test shares it)
    await asyncio.sleep(0.05)
    text = await (await rig.client.get("/metrics")).text()
    peak = float(
        next(x for x in text.splitlines() if x.startswith("voxpipe_gateway_loop_lag_max_seconds ")).split()[1]
    )
    assert peak >= 0.1, peak
    slow = next(
        x for x in text.splitlines() if x.startswith('voxpipe_gateway_loop_lag_seconds_bucket{le="0.1"}')
    )
    count = next(x for x in text.splitlines() if x.startswith("voxpipe_gateway_loop_lag_seconds_count"))
    assert float(count.split()[1]) > float(slow.split()[1])  # a wake later than 100 ms
