"""Several prompt lanes (`--prompt-lane on --prompt-lanes N`): prompts that arrive while a step is in
flight start side by side, one a free lane, and one that finds every lane busy waits for a lane or
the next step. Each request samples what it samples alone and gets the same audio windows as with
the lanes off (Orpheus, CSM and Qwen3-TTS, tiny, CPU: a lane's first step runs eagerly in its
place, the engine's handling is the same; `Held` stands in for a lane's event on a device, so that
a lane stays in flight until the test ends it). A lane's request takes no slot or KV page that
another lane in flight holds or gave back; what a lane's request gave back goes to a step only
after the main stream waits on that lane; a lane dropped unfinished leaves a fence that the steps
and the next lanes wait on until it has passed."""

from __future__ import annotations

import pytest

from common.cli import _validate
from common.config import GpuWorkerSettings, ServeConfig
from common.messages import FinishReason, Prompt
from common.options import parse_role
from gpu_worker.engine import Engine
from tests import test_prompt_lane_starts_a_prompt_beside_the_step_in_flight as one_lane
from tests.test_a_burst_is_admitted_several_prompts_a_step_with_the_tokens_each_gets_alone import prompts

# the one lane's tests' tiny programs (float64, the fixture), settings and outputs alone
program, limits, alone = one_lane.program, one_lane.limits, one_lane.alone


def lanes(program, n: int = 2, **kw) -> Engine:
    eng = Engine(program, limits(prompt_lane="on", prompt_lanes=n, **kw))
    eng.outputs = {}
    return eng


class Held:
    """A CUDA event's stand-in for a lane's work on a device: it has ended once the test says so
    (`done`); `wait` (a stream told to wait for it) calls `on_wait` and counts."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0
        self.on_wait = lambda: None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.done, "the engine collects a lane only once its work has ended"

    def wait(self, stream=None) -> None:
        self.waits += 1
        self.on_wait()


def hold_lanes(eng: Engine) -> list[Held]:
    """Each lane's step launched after this call stays in flight until its `Held` (in launch order)
    is done."""
    launch, held = eng.runner.launch_lane, []

    def launch_held(req, lane):
        step = launch(req, lane)
        step.ready = Held()
        held.append(step.ready)
        return step

    eng.runner.launch_lane = launch_held
    return held


def one_in_a_lane(program, n_prompts: int, n_lanes: int) -> tuple[list[Prompt], Engine, list[Held]]:
    """`n_prompts` prompts and an engine of `n_lanes` held lanes: the first prompt runs in a step,
    the second in lane 0 beside it."""
    ps = prompts(program, n_prompts)
    eng = lanes(program, n_lanes)
    held = hold_lanes(eng)
    eng.add(ps[0])
    eng.step()
    eng.add(ps[1])
    eng.lane_step()
    return ps, eng, held


def finish(eng: Engine, held: list[Held] = ()) -> None:
    """Every lane's work ends; the engine runs until idle, the worker's turns: a step, then the
    lanes'."""
    for h in held:
        h.done = True
    while eng.has_work():
        eng.step()
        eng.lane_step()
    eng.scheduler.check()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == eng.limits.max_batch_size


def serve(program, ps: list[Prompt], lane: str, n: int) -> tuple[dict, dict, Engine]:
    """Prompts arrive `n` at a time, a burst every other step, to `n` lanes (the one lane's
    `serve`) → (outputs, each request's audio windows in order, the engine)."""
    return one_lane.serve(program, ps, lane, lanes=n, at_once=n)


def test_prompts_start_in_lanes_side_by_side_and_sample_what_they_sample_alone(program):
    ps = prompts(program, 7)
    by_itself = alone(program, ps)
    on, windows_on, eng = serve(program, ps, "on", 2)
    off, windows_off, _ = serve(program, ps, "off", 2)
    assert eng.lane_prompts == len(ps) - 2  # the first burst found no step in flight
    for p in ps:
        rows, reason = on[p.rid]
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert rows == by_itself[p.rid][0] == off[p.rid][0], f"{p.rid}: a lane changed its rows"
    assert windows_on == windows_off
    eng.scheduler.check()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == eng.limits.max_batch_size


@pytest.mark.parametrize("n", [1, 2])
def test_n_prompts_arriving_during_one_step_start_in_lanes_and_the_next_waits_for_one(program, n):
    ps = prompts(program, n + 2)
    eng = lanes(program, n)
    held = hold_lanes(eng)
    eng.add(ps[0])
    eng.step()  # in flight
    for p in ps[1:]:
        eng.add(p)
    eng.lane_step()
    started = [eng.running[p.rid] for p in ps[1 : n + 1]]
    assert all(r.lane for r in started) and eng.lane_prompts == n
    assert sorted(step.lane for step in eng._lanes) == list(range(n))
    assert [r.rid for r in eng.waiting] == [ps[n + 1].rid]  # every lane busy
    eng.lane_step()
    assert len(eng.waiting) == 1
    eng.step()  # the lanes' requests stay out of the steps until their rows are on the host
    assert not any(r in eng._inflight.batch for r in started) and ps[n + 1].rid in eng.running
    held[0].done = True
    eng.lane_step()
    assert not started[0].lane and [s.batch[0] for s in eng._lanes] == started[1:]
    eng.step()
    assert started[0] in eng._inflight.batch
    finish(eng, held)
    by_itself = alone(program, ps)
    assert all(eng.outputs[p.rid][0] == by_itself[p.rid][0] for p in ps)


def test_a_free_lane_takes_the_next_prompt_while_the_others_are_busy(program):
    ps = prompts(program, 4)
    eng = lanes(program, 2)
    held = hold_lanes(eng)
    eng.add(ps[0])
    eng.step()
    eng.add(ps[1])
    eng.add(ps[2])
    eng.lane_step()  # lanes 0 and 1
    held[1].done = True  # lane 1 ends first
    eng.add(ps[3])
    eng.lane_step()
    assert eng.running[ps[3].rid].lane
    assert {s.batch[0].rid: s.lane for s in eng._lanes} == {ps[1].rid: 0, ps[3].rid: 1}
    finish(eng, held)


def test_a_lane_request_avoids_what_another_lane_in_flight_holds_or_gave_back(program):
    ps, eng, held = one_in_a_lane(program, 4, 3)
    first = eng.running[ps[1].rid]
    eng.abort(ps[1].rid)  # ends while its lane runs
    slot, pages = first.released
    assert slot == eng.slots._free[-1]  # free, and next in line
    eng.add(ps[2])
    eng.lane_step()
    second = eng.running[ps[2].rid]
    assert second.lane and second.slot != slot and not set(second.pages) & set(pages)
    avoid_slots, avoid_pages = eng._lane_avoids(eng._inflight)
    assert {slot, second.slot} <= avoid_slots
    assert set(pages) | set(second.pages) <= avoid_pages
    eng.add(ps[3])
    eng.lane_step()
    third = eng.running[ps[3].rid]
    assert third.slot not in (slot, second.slot)
    assert not set(third.pages) & (set(pages) | set(second.pages))
    held[0].done = True
    out = eng.lane_step()  # collects the aborted request's lane: its end goes out, none of its audio
    assert all(c.rid != ps[1].rid for c in out.chunks)
    assert (ps[1].rid, FinishReason.ABORT) in [(f.rid, f.reason) for f in out.finished]
    avoid_slots, avoid_pages = eng._lane_avoids(eng._inflight)
    assert slot not in avoid_slots and not set(pages) & avoid_pages  # its lane's work is done
    finish(eng, held)
    assert all(eng.outputs[p.rid][1] in (FinishReason.STOP, FinishReason.LENGTH) for p in ps[2:])


def test_what_a_lane_request_gave_back_goes_to_a_step_only_after_the_main_stream_waits(program):
    ps, eng, held = one_in_a_lane(program, 3, 2)
    eng.abort(ps[1].rid)
    admitted_then = []
    held[0].on_wait = lambda: admitted_then.append(ps[2].rid in eng.running)
    eng.add(ps[2])
    eng.step()  # admits ps[2], which may take what ps[1] gave back
    assert admitted_then == [False], "the main stream waits on the lane before the step's admission"
    eng.step()
    assert held[0].waits == 2  # before each step while the lane runs
    held[0].done = True
    eng.lane_step()
    eng.step()
    assert held[0].waits == 2 and not eng._lanes
    finish(eng, held)


def test_a_lane_dropped_unfinished_leaves_a_fence_the_steps_and_next_lanes_wait_on(program):
    ps, eng, held = one_in_a_lane(program, 4, 2)
    eng.fail_all("a step failed")  # its lane's work may still run on the device
    assert eng._lane_fences == [held[0]] and not eng._lanes
    assert eng.allocator.num_used == 0  # everything back in the pool
    eng.step()  # the worker's step after a failure: the finished requests go out
    assert held[0].waits == 1
    eng.add(ps[2])
    eng.step()
    assert held[0].waits == 2 and ps[2].rid in eng.running
    admitted_then = []
    held[0].on_wait = lambda: admitted_then.append(ps[3].rid in eng.running)
    eng.add(ps[3])
    eng.lane_step()  # the new lane's stream waits on the fence before its admission writes
    assert eng.running[ps[3].rid].lane and admitted_then == [False]
    held[0].done = True  # the dropped work has passed: no fence is left
    eng.lane_step()
    assert eng._lane_fences == []
    waits = held[0].waits
    finish(eng, held)
    assert held[0].waits == waits
    assert all(eng.outputs[p.rid][1] in (FinishReason.STOP, FinishReason.LENGTH) for p in ps[2:])


class Waited(Held):
    """A step's event that the host finds running once (the engine's wait then takes its turn,
    `Engine.on_wait`) and ended the next time it looks."""

    def query(self) -> bool:
        done, self.done = self.done, True
        return done

    def synchronize(self) -> None:  # blocks until it has ended
        self.done = True


def test_a_prompt_arriving_while_the_host_waits_for_a_step_starts_in_a_lane_then(program, monkeypatch):
    ps = prompts(program, 4)
    eng = lanes(program, 2)
    held = hold_lanes(eng)
    for p in ps[:2]:
        eng.add(p)
    while len(eng.running) < 2 or any(eng.running[p.rid].n_gen == 0 for p in ps[:2]):
        eng.step()
    # From here each step's event is found running once by the wait for its results.
    launch = eng.runner.launch

    def launch_waited(batch):
        step = launch(batch)
        step.ready = Waited()
        return step

    monkeypatch.setattr(eng.runner, "launch", launch_waited)
    monkeypatch.setattr(eng.runner, "_time_on_device", lambda step: None)  # a CPU step has no timing
    seen = []

    def on_wait() -> None:  # the worker's turn while it waits: a prompt arrives, the lanes' turn
        waited = eng._waiting
        if not seen:
            eng.add(ps[2])
        eng.lane_step()
        seen.append((waited, ps[2].rid in eng.running and eng.running[ps[2].rid].lane))

    eng.on_wait = on_wait
    eng.step()  # launches a step with both requests in it, collects the one before
    in_flight = eng._inflight
    eng.abort(ps[1].rid)  # ends while that step runs: it gave back what the step still writes
    gone = next(r for r in in_flight.batch if r.rid == ps[1].rid)
    slot, pages = gone.released
    assert slot == eng.slots._free[-1]  # free, and next in line
    eng.step()  # launches the next step, then waits for the one in flight: a lane takes ps[2]
    assert seen and seen[0] == (in_flight, True)
    started = eng.running[ps[2].rid]
    assert started.slot != slot and not set(started.pages) & set(pages)
    assert [s.batch[0] for s in eng._lanes] == [started]
    eng.on_wait = None
    for h in held:
        h.done = True
    eng.add(ps[3])
    while eng.has_work():
        eng.step()
        eng.lane_step()
    eng.scheduler.check()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == eng.limits.max_batch_size
    by_itself = alone(program, ps)
    assert eng.outputs[ps[1].rid][1] == FinishReason.ABORT
    assert all(eng.outputs[p.rid][0] == by_itself[p.rid][0] for p in (ps[0], ps[2], ps[3]))


class Inbox:
    """The worker's inbox: what `drain` returns, one list a call (then nothing)."""

    def __init__(self, *drains: list) -> None:
        self.drains = list(drains)

    def drain(self, timeout_ms: int = 0) -> list:
        return self.drains.pop(0) if self.drains else []


def turns_of(eng: Engine, sent: list):
    """A gpu_worker's turns alone over `eng` (no sockets, no process): what it sends to the codec
    into `sent`."""
    from gpu_worker.stages import StageReporter
    from gpu_worker.worker import GpuWorker

    worker = GpuWorker.__new__(GpuWorker)
    worker.engine, worker.stages, worker._deferred, worker._waited_on = eng, StageReporter(), [], None
    worker.to_codec = type("Push", (), {"send": staticmethod(sent.append)})()
    return worker


def test_the_worker_starts_prompts_while_it_waits_and_keeps_aborts_for_its_next_drain(program):
    from common.messages import Abort

    ps = prompts(program, 2)
    eng = lanes(program, 2)
    held = hold_lanes(eng)
    sent = []
    worker = turns_of(eng, sent)
    eng.add(ps[0])
    eng.step()  # in flight
    abort = Abort([ps[0].rid])
    worker.inbox = Inbox([ps[1], abort])
    worker.while_waiting()
    assert eng.running[ps[1].rid].lane  # started at once, in a lane
    assert not eng.running[ps[0].rid].done and worker._deferred == [abort]  # the abort waits
    turns = []
    lane_step = eng.lane_step
    eng.lane_step = lambda: turns.append(1) or lane_step()
    worker.while_waiting()  # nothing came and no lane ended: no lanes' turn
    assert turns == [] and not eng.lane_ended()
    eng.lane_step = lane_step
    worker.receive()  # the next drain takes it first
    assert eng.outputs[ps[0].rid][1] == FinishReason.ABORT and worker._deferred == []
    finish(eng, held)
    assert eng.outputs[ps[1].rid][0] == alone(program, ps[1:])[ps[1].rid][0]


def test_what_arrives_after_a_deferred_message_waits_behind_it(program):
    """A new gateway greets a busy worker with Abort(everything) and then sends its prompts: taken
    during a wait, the prompts would start before the abort that must not end them."""
    from common.messages import Abort

    ps = prompts(program, 3)
    eng = lanes(program, 2)
    held = hold_lanes(eng)
    worker = turns_of(eng, [])
    eng.add(ps[0])  # the old gateway's
    eng.step()
    greeting = Abort([], everything=True)
    worker.inbox = Inbox([greeting, ps[1]], [ps[2]])
    worker.while_waiting()
    worker.while_waiting()
    assert ps[1].rid not in eng.running and ps[2].rid not in eng.running
    assert worker._deferred == [greeting, ps[1], ps[2]]
    worker.receive()  # in arrival order: the old requests end, the new ones start
    assert eng.outputs[ps[0].rid][1] == FinishReason.ABORT
    assert {ps[1].rid, ps[2].rid} <= set(eng.running) | {r.rid for r in eng.waiting}
    finish(eng, held)
    assert all(eng.outputs[p.rid][1] in (FinishReason.STOP, FinishReason.LENGTH) for p in ps[1:])


def test_the_lanes_take_a_turn_once_a_wait_for_prompts_the_step_left_waiting(program):
    ps = prompts(program, 2)
    eng = lanes(program, 2)
    held = hold_lanes(eng)
    worker = turns_of(eng, [])
    worker.inbox = Inbox()
    eng.add(ps[0])
    eng.step()  # in flight
    eng.add(ps[1])  # left waiting by the step (no lanes' turn since)
    turns = []
    lane_step = eng.lane_step
    eng.lane_step = lambda: turns.append(1) or lane_step()
    eng._waiting = eng._inflight  # the host waits for a step
    worker.while_waiting()
    assert turns == [1] and eng.running[ps[1].rid].lane
    worker.while_waiting()  # the same wait, nothing new: no turn
    assert turns == [1]
    eng._waiting = None
    eng.lane_step = lane_step
    finish(eng, held)


def test_the_runners_wait_leaves_out_its_turns_and_dates_the_steps_end_after_the_last_look():
    import math
    import time

    from gpu_worker.runner.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner._time_on_device = lambda step: None
    looks = iter([False, False, True])
    event = type("Event", (), {"query": lambda self: next(looks), "synchronize": lambda self: None})()
    step = type("Step", (), {"ready": event})()
    started = []

    def turn() -> None:
        started.append(time.perf_counter())
        time.sleep(0.02)

    waited = runner.wait(step, turn)
    assert len(started) == 2 and waited < 0.02  # the turns' 40 ms are not the device's
    # it was running when the last turn began: the step's end is dated then, not at the return
    assert started[0] + 0.02 <= runner.ended_after <= started[-1]
    assert runner.wait(type("Step", (), {"ready": None})()) == 0.0 and runner.ended_after == math.inf


def test_without_held_lanes_on_a_cpu_n_prompts_start_in_one_turn(program):
    ps = prompts(program, 3)
    eng = lanes(program, 2)
    eng.add(ps[0])
    eng.step()
    eng.add(ps[1])
    eng.add(ps[2])
    eng.lane_step()  # eagerly in place, two lanes in flight until the next turn collects them
    assert eng.lane_prompts == 2 and len(eng._lanes) == 2 and not eng.waiting
    eng.lane_step()
    assert not eng._lanes and not any(r.lane for r in eng.running.values())
    finish(eng)


def test_the_option_is_one_lane_by_default_parsed_and_checked(program):
    assert GpuWorkerSettings().prompt_lanes == 1
    assert parse_role("gpu_worker", ["--prompt-lanes", "3"], {}).cfg.gpu.prompt_lanes == 3
    assert parse_role("gpu_worker", [], {"VOXPIPE_PROMPT_LANES": "2"}).cfg.gpu.prompt_lanes == 2
    with pytest.raises(SystemExit):
        parse_role("gpu_worker", ["--prompt-lanes", "two"], {})
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"--prompt-lanes .* 1 or more, got {bad}"):
            GpuWorkerSettings(prompt_lanes=bad).check()
        with pytest.raises(ValueError, match="--prompt-lanes"):
            _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(prompt_lanes=bad)))
        with pytest.raises(ValueError, match="--prompt-lanes"):  # a gpu_worker run alone checks it too
            Engine(program, limits(prompt_lane="on", prompt_lanes=bad))
    assert Engine(program, limits(prompt_lanes=4)).runner.num_lanes == 0  # the lanes off: none
