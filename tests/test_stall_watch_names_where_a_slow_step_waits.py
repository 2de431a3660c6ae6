"""The stall watch (gpu_worker/stall.py): a step that runs past its threshold comes back with the loop
thread's stack at that moment, innermost first; a quick step, and a step after a slow one, with
none; the watch sleeps between steps."""

from __future__ import annotations

import threading
import time

from gpu_worker.stall import StallWatch


def blocked_in_the_device_wait() -> None:
    time.sleep(0.15)  # lets go of the GIL, as a device wait does


def a_step(slow: bool) -> None:
    if slow:
        blocked_in_the_device_wait()


def test_a_stalled_step_names_where_its_thread_waits_and_a_quick_one_names_nothing():
    watch = StallWatch(after_s=0.03, period_s=0.005)
    try:
        watch.begin()
        a_step(slow=True)
        stack = watch.end()
        first = stack.split(" < ")
        assert first[0].endswith("blocked_in_the_device_wait"), stack
        assert "test_stall_watch_names_where_a_slow_step_waits.py:" in first[0]
        assert any(f.endswith("a_step") for f in first[1:]), stack
        for _ in range(20):
            watch.begin()
            a_step(slow=False)
            assert watch.end() == ""
        watch.begin()
        time.sleep(0.01)  # under the threshold
        assert watch.end() == ""
        time.sleep(0.05)  # no step: nothing taken
        assert watch.end() == ""
    finally:
        watch.close()
    assert not any(t.name == "stall-watch" and t.is_alive() for t in threading.enumerate())
