"""A guided request (Chatterbox: a conditional and an unconditional sequence) runs both of its
prompts in the step that admits it, so admission counts both against `--max-prefill-rows`; a
guided prompt whose rows do not split in two is refused alone; an aborted guided request gives
back both sequences' pages."""

from __future__ import annotations

import pytest

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.kv_cache import pages_for
from tests.conftest import tiny_lm_on_one_thread


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("chatterbox-tiny")


def prompt(program, rid: str, cut: int = 0) -> Prompt:
    built = program.preprocess("Hello there, how are you today?", {})
    rows = built.rows.astype("<i4")[: len(built.rows) - cut]
    state = {k: wire_array(v) for k, v in built.state.items()}
    sp = SamplingParams(max_tokens=len(rows) // 2 + 40, temperature=0.8, seed=1, min_tokens=30)
    return Prompt(rid, rows.tobytes(), len(rows), sp, state=state)


def test_a_step_admits_guided_prompts_by_both_sequences_rows(program) -> None:
    both = prompt(program, "x").n_rows  # conditional + unconditional rows of one request
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200, max_prefill_rows=both + 2))
    seen = []
    forward = eng.runner.forward_runner.forward

    def spy(b):
        seen.append(b.qo_indptr[b.num_prefill])
        return forward(b)

    eng.runner.forward_runner.forward = spy
    eng.add(prompt(program, "c"))
    eng.add(prompt(program, "d"))
    eng.step()
    assert eng.scheduler.admitted_last == 1 and seen[0] == both  # one request's two prompts, not two
    eng.step()
    assert eng.scheduler.admitted_last == 1  # the second in the next step


def test_an_odd_guided_prompt_is_refused_alone(program) -> None:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.add(prompt(program, "odd", cut=1))
    refused = [f for f in eng.scheduler.finished if f.rid == "odd"]
    assert refused and refused[0].reason == FinishReason.ERROR and "even number" in refused[0].message
    assert refused[0].status == 400
    eng.add(prompt(program, "ok"))
    eng.step()
    assert "ok" in eng.scheduler.running


def test_an_aborted_guided_request_gives_back_both_sequences_pages(program) -> None:
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200))
    eng.add(prompt(program, "a"))
    eng.add(prompt(program, "b"))
    for _ in range(5):
        eng.step()
    p = prompt(program, "a")
    budget = min(p.sampling.max_tokens, 200)
    assert eng.allocator.num_used == 2 * 2 * pages_for(budget + 1, eng.limits.page_size)  # 2 requests × 2
    eng.abort("a")
    eng.run_until_idle()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 4
