"""The prompt lane (`--prompt-lane on`): a prompt that arrives while a step is in flight starts at
once in the lane, the engine turns the lane's row into the request's first audio, and the request
runs in the steps from its second row. Each request samples what it samples alone, greedy and
sampled, on Orpheus, CSM and Qwen3-TTS (tiny, CPU: the lane's first step runs eagerly in its place,
the engine's handling is the same), and gets the same audio windows as with the lane off. A lane
request takes no slot or KV page that a request of the step in flight gave back (that step may
still write them); one aborted in the lane ends cleanly and leaks nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.kv_cache import PageAllocator
from gpu_worker.runner.slots import SlotState
from tests.conftest import tiny_lm_on_one_thread
from tests.test_a_burst_is_admitted_several_prompts_a_step_with_the_tokens_each_gets_alone import prompts


@pytest.fixture(scope="module", params=["orpheus-tiny", "csm-tiny", "qwen3-tts-tiny"])
def program(request):
    """float64: a GEMM of one row rounds as that row among others far below any sampling boundary
    (see test_a_burst_is_admitted_several_prompts_a_step_with_the_tokens_each_gets_alone.py)."""
    kw = {"lm_head": "audio"} if request.param == "orpheus-tiny" else {}
    yield from tiny_lm_on_one_thread(request.param, dtype=torch.float64, **kw)


def limits(**kw) -> GpuWorkerSettings:
    return GpuWorkerSettings(**{"max_batch_size": 8, "max_context": 200, "first_chunk": "reference", **kw})


def serve(
    program, ps: list[Prompt], lane: str, every: int = 2, lanes: int = 1, at_once: int = 1
) -> tuple[dict, dict, Engine]:
    """Prompts arrive `at_once` at a time every `every` steps, each arrival followed by the lanes'
    turn (`lanes` of them); the worker's turns: a step, then the lanes' → (outputs, each request's
    audio windows in order, the engine)."""
    eng = Engine(program, limits(prompt_lane=lane, prompt_lanes=lanes))
    eng.outputs = {}
    windows: dict[str, list] = {}

    def turn(out) -> None:
        for c in out.chunks if out is not None else []:
            windows.setdefault(c.rid, []).append((c.index, c.tokens, c.noise_id, c.tail_rows))

    pending = list(ps)
    steps = 0
    while pending or eng.has_work():
        if pending and steps % every == 0:
            for _ in range(min(at_once, len(pending))):
                eng.add(pending.pop(0))
            turn(eng.lane_step())  # the worker's turn right after taking its messages
        turn(eng.step())
        turn(eng.lane_step())
        steps += 1
    return eng.outputs, windows, eng


def alone(program, ps: list[Prompt]) -> dict:
    """Each prompt's outputs served by an engine of its own, nothing beside it."""
    out = {}
    for p in ps:
        eng = Engine(program, limits())
        eng.outputs = {}
        eng.add(p)
        eng.run_until_idle()
        out |= eng.outputs
    return out


def test_prompts_start_in_the_lane_and_sample_what_they_sample_alone(program):
    ps = prompts(program, 5)
    by_itself = alone(program, ps)
    on, windows_on, eng = serve(program, ps, "on")
    off, windows_off, _ = serve(program, ps, "off")
    assert eng.lane_prompts == len(ps) - 1  # the first found no step in flight
    assert eng.metrics()["prompts_in_lane_total"] == len(ps) - 1
    for p in ps:
        rows_on, reason = on[p.rid]
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert rows_on == by_itself[p.rid][0], f"{p.rid}: the lane changed its rows"
        assert rows_on == off[p.rid][0]
    assert windows_on == windows_off
    eng.scheduler.check()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == eng.limits.max_batch_size


def test_a_lane_request_avoids_the_slot_and_pages_a_request_of_the_step_in_flight_gave_back(program):
    first, second = prompts(program, 2)
    eng = Engine(program, limits(prompt_lane="on"))
    eng.outputs = {}
    eng.add(first)
    for _ in range(3):
        eng.step()
    held = eng.running[first.rid]
    assert held in eng._inflight.batch
    eng.abort(first.rid)  # ends while a step that holds it is in flight (a stop does the same)
    slot, pages = held.released
    assert slot == eng.slots._free[-1]  # free, and next in line
    eng.add(second)
    eng.lane_step()
    req = eng.running[second.rid]
    assert req.lane and req.slot != slot and not set(req.pages) & set(pages)
    while eng.has_work():
        eng.step()
        eng.lane_step()
    assert eng.outputs[second.rid][1] in (FinishReason.STOP, FinishReason.LENGTH)
    eng.scheduler.check()
    assert eng.allocator.num_used == 0


def test_a_request_aborted_in_the_lane_ends_and_leaks_nothing(program):
    first, second = prompts(program, 2)
    eng = Engine(program, limits(prompt_lane="on"))
    eng.outputs = {}
    eng.add(first)
    eng.step()
    eng.add(second)
    eng.lane_step()
    assert eng.running[second.rid].lane
    eng.abort(second.rid)
    out = eng.lane_step()  # collects the lane: its end goes out, none of its audio
    assert all(c.rid != second.rid for c in out.chunks)
    assert [(f.rid, f.reason) for f in out.finished] == [(second.rid, FinishReason.ABORT)]
    while eng.has_work():
        eng.step()
        eng.lane_step()
    assert eng.outputs[first.rid][1] in (FinishReason.STOP, FinishReason.LENGTH)
    eng.scheduler.check()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == eng.limits.max_batch_size


def test_above_its_batch_cap_the_lane_leaves_prompts_to_the_steps(program):
    ps = prompts(program, 3)
    eng = Engine(program, limits(prompt_lane="on", prompt_lane_max_batch=1))
    eng.outputs = {}
    eng.add(ps[0])
    eng.step()
    eng.add(ps[1])
    eng.lane_step()  # one request runs: at the cap, not above it
    assert eng.running[ps[1].rid].lane and eng.lane_prompts == 1
    eng.step()
    eng.lane_step()  # the lane's row collected
    eng.add(ps[2])
    eng.lane_step()  # two run: above the cap, the prompt waits for a step
    assert eng.lane_prompts == 1 and [r.rid for r in eng.waiting] == [ps[2].rid]
    eng.step()
    assert ps[2].rid in eng.running and not eng.running[ps[2].rid].lane
    while eng.has_work():
        eng.step()
        eng.lane_step()
    assert all(eng.outputs[p.rid][1] in (FinishReason.STOP, FinishReason.LENGTH) for p in ps)
    eng.scheduler.check()
    assert eng.allocator.num_used == 0


def test_with_the_lane_off_the_lane_step_does_nothing(program):
    first, second = prompts(program, 2)
    eng = Engine(program, limits())
    eng.add(first)
    eng.step()
    eng.add(second)
    assert eng.lane_step() is None and eng.lane_prompts == 0 and len(eng.waiting) == 1


def test_pages_and_slots_are_handed_out_around_the_ones_to_avoid():
    pages = PageAllocator(9)  # pages 1..8
    assert pages.alloc(3, avoid={1, 2}) == [3, 4, 5]
    assert pages.alloc(3, avoid={6, 7, 8}) is None and pages.num_free == 5  # nothing taken
    assert pages.alloc(2) == [1, 2]
    slots = SlotState(4, 8, 1, torch.device("cpu"))
    sp = SamplingParams(max_tokens=4)
    assert not slots.free_outside({0, 1, 2, 3})
    assert slots.admit(sp, np.array([1]), avoid={0}) == 1
    assert slots.admit(sp, np.array([1])) == 0
