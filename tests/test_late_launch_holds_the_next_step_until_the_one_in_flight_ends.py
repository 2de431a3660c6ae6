"""`--late-launch on`: the gpu_worker keeps taking messages until the step in flight is about to
end (its start, the steps' measured device time, less the host's launch time and a margin), so a
prompt that arrives meanwhile joins the next step; while prompts wait, the launch time is a prompt
step's (measured apart from a decode step's); the margin widens when the device waited for a
launch and narrows slowly while it did not; the hold ends with the step in flight if that ends
sooner than expected; off a GPU, or off, nothing is held."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from common.options import parse_role
from gpu_worker.engine import LATE_MARGIN_MIN_S, LATE_MARGIN_S, Engine
from gpu_worker.worker import GpuWorker
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", lm_head="audio")
    p.load_lm()
    return p


class _Event:
    """A CUDA event's stand-in: `query()` says whether the step has ended."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def late_engine(program, on: bool = True) -> Engine:
    """An engine as a GPU's with late launch `on`, a step of 30 ms in flight that began now."""
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64, late_launch="on"))
    eng.late = on  # off a GPU the engine never holds (below); here as on one
    eng.runner.gpu_step_s = 0.030
    eng.launch_s = 0.004
    eng._inflight = SimpleNamespace(ready=_Event())  # a step on a device, not ended
    eng._began = time.perf_counter()
    return eng


def test_the_option_is_off_by_default_parsed_and_checked():
    assert GpuWorkerSettings().late_launch == "off"
    assert parse_role("gpu_worker", ["--late-launch", "on"], {}).cfg.gpu.late_launch == "on"
    with pytest.raises(ValueError, match="--late-launch"):
        GpuWorkerSettings(late_launch="yes").check()


def test_off_a_gpu_or_off_nothing_is_held(program):
    cpu = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64, late_launch="on"))
    assert not cpu.late
    cpu._inflight = SimpleNamespace(ready=_Event())
    assert cpu.hold_s() == 0.0
    assert late_engine(program, on=False).hold_s() == 0.0


def test_the_hold_ends_a_launch_and_a_margin_before_the_step_does(program):
    eng = late_engine(program)
    hold = eng.hold_s()
    assert 0.030 - 0.004 - LATE_MARGIN_S - 0.002 < hold <= 0.030 - 0.004 - LATE_MARGIN_S
    eng._began -= 0.020  # 20 ms into the step
    assert 0 < eng.hold_s() < hold - 0.019
    eng._inflight.ready.done = True  # it ended sooner than its steps' average: its results wait
    assert eng.hold_s() == 0.0
    eng._inflight.ready.done = False
    eng._began -= 0.010  # past its due time
    assert eng.hold_s() == 0.0
    eng._inflight = None  # nothing in flight: schedule now
    assert eng.hold_s() == 0.0


def _hold_ends(eng: Engine) -> float:
    """When the hold asked for now ends (perf_counter): the same whenever it is asked, so a
    comparison does not depend on the host's speed between the asks."""
    now = time.perf_counter()
    return now + eng.hold_s()


def test_while_prompts_wait_the_hold_leaves_a_prompt_steps_launch(program):
    eng = late_engine(program)
    eng.launch_prompt_s = 0.009  # a step that starts prompts takes longer to lay out and launch
    decode_only = _hold_ends(eng)
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    eng.add(Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=8)))
    with_prompt = _hold_ends(eng)
    assert decode_only - with_prompt == pytest.approx(0.009 - 0.004, abs=0.001)
    eng.launch_prompt_s = 0.001  # a prompt step's launch never holds longer than a decode step's
    assert _hold_ends(eng) == pytest.approx(decode_only, abs=0.001)


def test_launch_times_are_measured_apart_for_steps_with_prompts_and_without(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64))
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    eng.add(Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=20)))
    eng.step()  # the prompt's step
    assert eng.launch_prompt_s > 0.0 and eng.launch_s == 0.0
    prompt_launch = eng.launch_prompt_s
    eng.step()  # a decode step
    assert eng.launch_s > 0.0 and eng.launch_prompt_s == prompt_launch
    m = eng.metrics()
    assert m["step_launch_prompt_ms"] == round(1000 * prompt_launch, 3)


def test_the_margin_widens_when_the_device_waited_and_narrows_when_it_did_not(program):
    eng = late_engine(program)
    eng.runner.last_idle_s = 0.001  # the device sat 1 ms waiting for the last launch
    eng._follow_idle()
    assert eng.late_margin_s == pytest.approx(1.1 * LATE_MARGIN_S + 0.001)
    for _ in range(20):
        eng._follow_idle()
    assert eng.late_margin_s == pytest.approx(0.5 * eng.runner.gpu_step_s)  # at most half a step
    eng.runner.last_idle_s = 0.0
    wide = eng.late_margin_s
    eng._follow_idle()
    assert eng.late_margin_s == pytest.approx(0.98 * wide)
    eng.runner.last_idle_s = 0.0004  # what a step launched early still leaves idle: no widening
    eng._follow_idle()
    assert eng.late_margin_s == pytest.approx(0.98 * 0.98 * wide)
    for _ in range(800):
        eng._follow_idle()
    assert eng.late_margin_s == LATE_MARGIN_MIN_S
    eng.runner.last_idle_s = None  # no step before it to measure against: unchanged
    eng._follow_idle()
    assert eng.late_margin_s == LATE_MARGIN_MIN_S


class _Inbox:
    """An inbox whose messages come one per drain, recording each drain's timeout."""

    def __init__(self, msgs: list) -> None:
        self.msgs, self.timeouts = list(msgs), []

    def drain(self, timeout_ms: int = 0, limit: int = 100_000) -> list:
        self.timeouts.append(timeout_ms)
        if self.msgs:
            return [self.msgs.pop(0)]
        time.sleep(timeout_ms / 1000)
        return []


def test_the_worker_takes_what_arrives_during_the_hold_before_it_steps(program):
    eng = late_engine(program)
    eng.runner.gpu_step_s = 0.060
    worker = GpuWorker.__new__(GpuWorker)  # its loop's parts alone: no sockets, no model load
    worker.engine, worker._deferred = eng, []
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    prompts = [
        Prompt(rid=f"r{i}", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=8))
        for i in range(2)
    ]
    worker.inbox = _Inbox(prompts)  # one at once, the other during the hold
    t0 = time.perf_counter()
    worker.receive()
    took = time.perf_counter() - t0
    assert [r.rid for r in eng.waiting] == ["r0", "r1"]  # both taken before the next step
    assert eng.hold_s() < 0.001
    assert 0.060 - eng.launch_s - eng.late_margin_s - 0.003 < took < 0.060
    assert worker.inbox.timeouts[1:] and set(worker.inbox.timeouts[1:]) == {1}  # drains of 1 ms, not a spin


class _DeviceEvent(_Event):
    """A step's end on a simulated device that runs launched steps one after another."""

    def __init__(self, end: float) -> None:
        super().__init__()
        self.end = end

    def query(self) -> bool:
        return time.perf_counter() >= self.end


def test_the_engine_knows_when_the_step_in_flight_began_and_holds_to_its_end(program):
    """Steps of 80 ms on a simulated device queue: the first starts at its launch, the next when
    the one before it ends (the engine learns it when its wait returns), and the hold of each ends
    a launch and a margin before the step in flight does."""
    step_s = 0.080
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64, late_launch="on"))
    eng.late = True
    eng.runner.gpu_step_s = step_s
    queue = {"end": 0.0}
    launch = eng.runner.launch

    def launch_on_device(batch):
        start = time.perf_counter()  # its kernels reach the device as the host launches them
        step = launch(batch)  # the CPU's step, computed now
        queue["end"] = max(start, queue["end"]) + step_s
        step.ready = _DeviceEvent(queue["end"])
        return step

    def wait(step, on_wait=None):
        t0 = time.perf_counter()
        while not step.ready.query():
            time.sleep(0.0005)
        eng.runner.last_idle_s = None
        return time.perf_counter() - t0

    eng.runner.launch, eng.runner.wait = launch_on_device, wait
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    eng.add(Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=40)))
    eng.step()  # the first step: the device was idle, it begins at its launch
    first_end = eng._inflight.ready.end
    eng.launch_s = 0.030  # the host's launch time, longer than this CPU's (its average starts at 0)
    assert abs(eng._began - (first_end - step_s)) < 0.015
    hold = eng.hold_s()
    assert abs(hold - (first_end - eng.launch_s - eng.late_margin_s - time.perf_counter())) < 0.015
    time.sleep(hold)
    eng.step()  # the second, launched before the first ended; its start is the first's end
    assert abs(eng._began - first_end) < 0.015
    second_end = eng._inflight.ready.end
    assert second_end == pytest.approx(first_end + step_s)
    assert 0.080 - eng.launch_s - eng.late_margin_s - 0.015 < eng.hold_s() < 0.080
    time.sleep(max(0.0, second_end - time.perf_counter()) + 0.010)  # held past its end
    processed = eng.step_count
    eng.step()  # the second ended before the third's launch: processed first, nothing launched
    assert eng.step_count == processed + 1 and eng._inflight is None
    t0 = time.perf_counter()
    eng.step()  # the third: the device idle when it is launched; dated from its launch's start
    assert t0 <= eng._began <= eng._inflight.ready.end - step_s


def test_a_step_that_ended_before_the_next_launch_sends_its_frames_first(program):
    """With late launch, a step found ended when the next would be scheduled is processed first
    (its frames leave without waiting for a launch); the next call launches. Off, the engine
    launches first, then processes (one step ahead of the host)."""
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    order: dict[bool, list[str]] = {}
    for on in (True, False):
        eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64, late_launch="on"))
        eng.late = on
        calls = order[on] = []
        launch, process = eng.runner.launch, eng._process

        def launch_ended(batch, launch=launch, calls=calls):
            calls.append("launch")
            step = launch(batch)
            step.ready = _Event()
            step.ready.done = True  # it has ended by the time the engine looks
            return step

        eng.runner.launch = launch_ended
        eng.runner.wait = lambda step, on_wait=None: 0.0  # the CPU's step is computed at its launch
        eng._process = lambda step, process=process, calls=calls: (calls.append("process"), process(step))[1]
        eng.add(
            Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=40))
        )
        for _ in range(3):
            eng.step()
    assert order[True] == ["launch", "process", "launch"]
    assert order[False] == ["launch", "launch", "process", "launch", "process"]


def test_a_device_error_in_the_hold_is_left_to_the_step_that_waits(program):
    """`query()` raising (a device fault) ends the hold; the step's wait raises it, where the
    worker fails every request with the error."""
    eng = late_engine(program)

    def fault() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng._inflight.ready.query = fault
    assert eng.hold_s() == 0.0


def test_an_empty_step_leaves_the_device_idle_from_the_processed_steps_end(program, monkeypatch):
    """A step that launches nothing but processes the one before: `runner.idle()` comes after that
    step's wait, so the idle measured before the next launch is not the lull counted as lateness."""
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64))
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    eng.add(Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=40)))
    eng.step()
    calls: list[str] = []
    wait, idle = eng.runner.wait, eng.runner.idle
    monkeypatch.setattr(
        eng.runner, "wait", lambda step, on_wait=None: (calls.append("wait"), wait(step, on_wait))[1]
    )
    monkeypatch.setattr(eng.runner, "idle", lambda: (calls.append("idle"), idle())[1])
    monkeypatch.setattr(eng.scheduler, "schedule", lambda *a, **k: [])
    eng.step()
    assert calls == ["wait", "idle"]
    assert eng._inflight is None


def test_a_collect_only_step_returns_its_results_and_idles_the_device_when_nothing_is_left(program):
    """The last step of the last request, found ended: its results and the request's end come
    back from the collect-only call, and with nothing left to launch the device's idle is dated
    from there (a pause until the next prompt is not a late launch); its host time joins the
    launch after it."""
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=64, late_launch="on"))
    eng.late = True
    calls: list[str] = []
    launch, process, idle = eng.runner.launch, eng._process, eng.runner.idle

    def launch_ended(batch):
        calls.append("launch")
        step = launch(batch)
        step.ready = _Event()
        step.ready.done = True
        return step

    eng.runner.launch, eng.runner.wait = launch_ended, lambda step, on_wait=None: 0.0
    eng._process = lambda step: (calls.append("process"), process(step))[1]
    eng.runner.idle = lambda: (calls.append("idle"), idle())[1]
    eng.add(Prompt(rid="r0", tokens=rows.tobytes(), n_rows=len(rows), sampling=SamplingParams(max_tokens=10)))
    out, host_moved = [], []
    while eng.has_work():
        before = eng.host_s
        out.append(eng.step())
        host_moved.append((calls[-1], eng.host_s != before))
    # a collect-only call's host time waits for the launch after it: one average a step
    assert all(moved == (last == "launch") for last, moved in host_moved[:-1]), host_moved
    ended = [f.rid for b in out if b is not None for f in b.finished]
    assert ended == ["r0"]
    assert calls[-2:] == ["process", "idle"] and calls.count("launch") == calls.count("process")
    assert calls[:3] == ["launch", "process", "launch"]  # collected first, then launched
