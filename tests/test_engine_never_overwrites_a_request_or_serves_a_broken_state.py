"""The engine never lets a request take another's place: a prompt whose id is already running or
waiting is refused, a request is admitted only into a free slot, and a state it knows is broken
(a slot or KV page held by no request) ends every request with an explicit error and is reset,
so the worker serves on instead of failing every later step."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    return p


def prompt(rid: str, max_tokens: int = 60) -> Prompt:
    rows = np.array([128259, 128000, 40, 128009, 128260, 128261, 128257], dtype="<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=max_tokens, constrained=True))


def run(engine: Engine) -> list:
    return [f for batch in engine.run_until_idle() for f in batch.finished]


@pytest.mark.parametrize("started", [False, True], ids=["waiting", "running"])
def test_a_prompt_with_the_id_of_a_request_held_is_refused(program, started: bool) -> None:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.add(prompt("q"))
    if started:
        eng.step()
        assert "q" in eng.running
    eng.add(prompt("q"))
    done = run(eng)
    refused = [f for f in done if f.reason == FinishReason.ERROR]
    assert len(refused) == 1 and "already" in refused[0].message and refused[0].status == 409
    assert [f.reason for f in done if f.reason != FinishReason.ERROR] == [FinishReason.LENGTH]
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 4, "the first one's slot leaked"


def test_a_slot_held_by_no_request_fails_the_step_then_the_engine_is_reset_and_serves(program) -> None:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=2, max_context=200))
    eng.add(prompt("a", max_tokens=150))
    eng.step()
    for _ in range(eng.slots.num_free):  # every free slot leaks: the state is broken
        eng.slots.admit(SamplingParams(), np.zeros(1, np.int64))
    eng.add(prompt("b"))
    with pytest.raises(RuntimeError, match="slot"):
        eng.step()
    assert "b" not in eng.running, "admitted without a free slot"
    eng.fail_all("gpu_worker step failed")  # as the worker does after a failed step
    ended = run(eng)
    assert {f.rid: (f.reason, f.status) for f in ended} == {
        "a": (FinishReason.ERROR, 500), "b": (FinishReason.ERROR, 500)
    }  # fmt: skip
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 2
    for rid in ("c", "d"):
        eng.add(prompt(rid))
    assert sorted((f.rid, f.reason) for f in run(eng)) == [
        ("c", FinishReason.LENGTH),
        ("d", FinishReason.LENGTH),
    ]


def test_kv_pages_held_by_no_request_fail_the_step_and_are_given_back(program) -> None:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=2, max_context=200))
    eng.add(prompt("a", max_tokens=150))
    eng.step()
    leaked = eng.allocator.alloc(3)
    assert leaked is not None
    with pytest.raises(RuntimeError, match="KV pages"):
        eng.step()
    eng.fail_all("gpu_worker step failed")
    assert [(f.rid, f.reason) for f in run(eng)] == [("a", FinishReason.ERROR)]
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 2
