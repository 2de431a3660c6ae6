"""The engine turns bad prompts, early aborts and failed steps into explicit endings, and never
leaks KV pages or sampling slots."""

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


def prompt(rid: str, ids: list[int], max_tokens: int = 60) -> Prompt:
    rows = np.array(ids, dtype="<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=max_tokens, constrained=True))


def finished(engine: Engine) -> dict:
    return {f.rid: f for batch in engine.run_until_idle() for f in batch.finished}


def test_out_of_vocabulary_prompt_ids_fail_that_request_only(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.add(prompt("bad", [128000, 10**7]))
    eng.add(prompt("neg", [128000, -5]))
    eng.add(prompt("ok", [128259, 128000, 40, 128009, 128260, 128261, 128257]))
    done = finished(eng)
    assert done["bad"].reason == FinishReason.ERROR and done["bad"].status == 400
    assert done["neg"].reason == FinishReason.ERROR
    assert done["ok"].reason == FinishReason.LENGTH and done["ok"].n_chunks > 0
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 4


def test_an_abort_that_overtakes_its_prompt_drops_the_prompt(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.abort("early")
    eng.add(prompt("early", [128000, 40, 41]))
    done = finished(eng)
    assert done["early"].reason == FinishReason.ABORT and done["early"].n_tokens == 0


def test_abort_mid_stream_frees_pages_and_slot(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=2, max_context=200))
    eng.add(prompt("a", [128000, 40, 41], max_tokens=200))
    for _ in range(5):
        eng.step()
    assert eng.allocator.num_used > 0
    eng.abort("a")
    done = finished(eng)
    assert done["a"].reason == FinishReason.ABORT
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 2


def test_a_failed_step_ends_every_request_with_an_error(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    for i in range(3):
        eng.add(prompt(f"r{i}", [128000, 40 + i, 41], max_tokens=150))
    eng.step()
    eng.add(prompt("queued", [128000, 50]))
    eng.fail_all("boom")
    done = finished(eng)
    assert {r: f.reason for r, f in done.items()} == {
        "r0": FinishReason.ERROR, "r1": FinishReason.ERROR, "r2": FinishReason.ERROR, "queued": FinishReason.ERROR
    }  # fmt: skip
    assert all(f.status == 500 and "boom" in f.message for f in done.values())
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 4


def test_a_prompt_whose_bytes_do_not_match_its_rows_is_refused(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    bad = Prompt("bad", np.array([1, 2, 3], dtype="<i4").tobytes(), 5, SamplingParams(max_tokens=60))
    eng.add(bad)
    eng.add(prompt("ok", [128259, 300, 128009], max_tokens=40))
    done = finished(eng)
    assert done["bad"].status == 400 and "bytes" in done["bad"].message
    assert done["ok"].reason != FinishReason.ERROR


def test_a_budget_larger_than_the_whole_kv_cache_is_refused_not_left_waiting(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200, num_pages=5))
    eng.add(prompt("big", [128259, 300, 128009], max_tokens=200))
    eng.add(prompt("small", [128259, 300, 128009], max_tokens=40))
    done = finished(eng)
    assert done["big"].status == 400 and "--num-pages" in done["big"].message
    assert done["small"].reason != FinishReason.ERROR
    assert eng.allocator.num_used == 0
