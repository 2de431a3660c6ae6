"""A step past the engine's slow-step threshold is recorded with where its time went (schedule,
launch, the wait for the previous step, processing), the batch it launched and the prompts in it,
and counted (`slow_steps_total`); on a CPU no threshold applies unless one is set."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import SLOW_STEP_S, Engine
from tests.conftest import tiny_lm_on_one_thread


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("orpheus-tiny")


def prompt(program, rid: str) -> Prompt:
    rows = np.asarray(program.preprocess("Hello there.", {})).astype("<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=len(rows) + 14, temperature=0.0))


def test_every_step_past_the_threshold_is_recorded_with_its_parts(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=100))
    assert eng.slow_step_s == float("inf") and SLOW_STEP_S < 0.05  # CPU: none recorded by default
    eng.add(prompt(program, "a"))
    eng.step()
    assert eng.slow_steps == 0 and eng.slow_step is None and eng.metrics()["slow_steps_total"] == 0

    eng.slow_step_s = 0.0  # every step is slow
    eng.add(prompt(program, "b"))
    eng.add(prompt(program, "c"))
    eng.step()  # starts b and c beside a
    slow = eng.slow_step
    assert eng.slow_steps == 1 and slow is not None
    assert (slow["batch"], slow["prompts"]) == (3, 2)
    parts = slow["schedule"] + slow["launch"] + slow["wait"] + slow["process"]
    assert slow["wall"] > 0 and abs(parts - slow["wall"]) < 0.05, slow
    assert min(slow["schedule"], slow["launch"], slow["wait"], slow["process"]) >= 0
    assert 0 < slow["cpu"] <= slow["wall"] + 1 and slow["gc"] >= 0
    eng.step()  # decode only
    assert eng.slow_steps == 2 and (eng.slow_step["batch"], eng.slow_step["prompts"]) == (3, 0)
    assert eng.slow_step["step"] > slow["step"]
    assert eng.metrics()["slow_steps_total"] == 2
    eng.run_until_idle()
    assert eng.allocator.num_used == 0


def test_a_collection_during_a_step_is_counted_as_its_gc_time(program):
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=100))
    eng.slow_step_s = 0.0
    eng.add(prompt(program, "a"))
    garbage = []
    for _ in range(200_000):  # a heap for a full collection to walk, kept alive meanwhile
        garbage.append([None])
    real = eng.runner.launch

    def launch_and_collect(batch):
        gc.collect()
        return real(batch)

    eng.runner.launch = launch_and_collect
    eng.step()
    assert eng.slow_step["gc"] > 1.0, eng.slow_step  # ms: a full collection over 200k lists
    assert eng.slow_step["gc"] <= eng.slow_step["launch"] + 0.5
    eng.runner.launch = real
    del garbage
    gc.collect()
    eng.step()
    assert eng.slow_step["gc"] < 1.0  # none forced: at most a young generation's
    eng.run_until_idle()
