"""The prompts one step starts: at most the runner's bound (`max_prefills_per_step`, its prefill
graphs), `--max-prefills` and `--max-prefill-rows` (a prompt longer than that still starts, alone);
the rest wait their turn in arrival order and all finish."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    return p


@pytest.mark.parametrize(
    "runner, setting, rows, running",
    [
        (1, 0, 8192, [1, 2, 3, 4, 5]),  # one prefill graph: one a step
        (3, 2, 8192, [2, 4, 5]),  # the setting within the runner's bound
        (2, 4, 8192, [2, 4, 5]),  # the runner's bound within the setting
        (0, 0, 8192, [5]),  # neither: the whole burst in one step
        (0, 0, 15, [2, 4, 5]),  # 7 rows a prompt, 15 rows a step
        (0, 0, 3, [1, 2, 3, 4, 5]),  # every prompt over the rows: each alone
    ],
)
def test_a_step_starts_no_more_prompts_than_the_runner_the_setting_and_the_rows_allow(
    program, runner, setting, rows, running
):
    limits = GpuWorkerSettings(
        max_batch_size=8,
        max_context=120,
        first_chunk="reference",
        max_prefills=setting,
        max_prefill_rows=rows,
    )
    eng = Engine(program, limits)
    eng.runner.forward_runner.max_prefills_per_step = runner
    eng.outputs = {}
    prompt = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    for i in range(5):
        sp = SamplingParams(max_tokens=40, constrained=True, seed=i)
        eng.add(Prompt(f"r{i}", prompt.tobytes(), len(prompt), sp))
    got = []
    while eng.waiting:
        eng.step()
        got.append(len(eng.running))
    assert got == running
    assert list(eng.running) == [f"r{i}" for i in range(5)]
    eng.run_until_idle()
    assert sorted(eng.outputs) == [f"r{i}" for i in range(5)]
    assert eng.allocator.num_used == 0
