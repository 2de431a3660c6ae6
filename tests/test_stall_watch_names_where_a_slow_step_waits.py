"""The stall watch (gpu_worker/stall.py): a step that runs past its threshold comes back with the loop
thread's stack at that moment, innermost first, and how far into the step it was taken (a thread
that keeps the GIL is caught only after it lets go: the time says so); a quick step, and a step
after a slow one, with none; the watch sleeps between steps."""

from __future__ import annotations

import re
import threading
import time

import pytest

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
        where, when = stack.rsplit(", ", 1)
        assert 30 <= float(when.split(" ms into the step")[0]) < 150, stack  # caught in the wait
        first = where.split(" < ")
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


BACKTRACKS = re.compile(r"(a+)+$")


def held_in_a_call_that_keeps_the_gil(n: int) -> None:
    BACKTRACKS.match("a" * n + "b")  # one C call that keeps the GIL, ~2^n steps: no thread runs


def test_a_thread_that_keeps_the_gil_is_caught_once_it_lets_go_and_the_time_says_so():
    watch = StallWatch(after_s=0.03, period_s=0.005)
    try:
        for n in range(18, 26):  # until the match outlasts twice the threshold on this machine
            watch.begin()
            t0 = time.perf_counter()
            held_in_a_call_that_keeps_the_gil(n)
            took = time.perf_counter() - t0
            time.sleep(0.02)  # the watch has had its turn by the end of this
            stack = watch.end()
            if took > 0.06:
                break
        else:
            pytest.skip("the match took less than twice the threshold here")
        ms = float(stack.rsplit(", ", 1)[1].split(" ms into the step")[0])
        # Taken as the call let go of the GIL, not at the threshold: the time tells a thread that
        # kept the GIL from one that waited (caught ~30 ms in)
        assert ms >= 1000 * took - 10, (stack, took)
    finally:
        watch.close()


def test_a_step_stalled_in_an_import_names_the_module_and_the_line_importing_it(tmp_path, monkeypatch):
    """An import's own frames (`<frozen importlib._bootstrap>`) are left out: the stack shows the
    module being run and the line of the step that imported it."""
    (tmp_path / "slow_to_import_xyz.py").write_text(
        "import time\n\ntime.sleep(0.15)  # a large module's load\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    watch = StallWatch(after_s=0.03, period_s=0.005)
    try:
        watch.begin()
        import slow_to_import_xyz  # noqa: F401

        stack = watch.end()
    finally:
        watch.close()
    frames = stack.rsplit(", ", 1)[0].split(" < ")
    assert not any("<frozen" in f for f in stack.split(" < ")), stack
    assert frames[0] == f"{tmp_path.name}/slow_to_import_xyz.py:3 <module>", stack
    assert frames[1].startswith("tests/test_stall_watch_names_where_a_slow_step_waits.py:"), stack
    assert frames[1].endswith(
        " test_a_step_stalled_in_an_import_names_the_module_and_the_line_importing_it"
    ), stack
