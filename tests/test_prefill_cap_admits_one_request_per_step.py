"""With prefill graphs (one request each, for batch invariance) the engine admits at most the
runner's `max_prefills_per_step` new requests per step; the rest wait their turn and all finish."""

from __future__ import annotations

import numpy as np

from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine, EngineLimits
from programs import get_spec, load_program_class


def test_new_requests_are_admitted_one_per_step_when_the_runner_says_so():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    eng = Engine(p, EngineLimits(max_batch_size=8, max_context=120, first_chunk="reference"))
    eng.runner.forward_runner.max_prefills_per_step = 1
    eng.outputs = {}
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    for i in range(4):
        sp = SamplingParams(max_tokens=40, constrained=True, seed=i)
        eng.add(Prompt(f"r{i}", rows.tobytes(), len(rows), sp))
    running = []
    for _ in range(4):
        eng.step()
        running.append(len(eng.running))
    assert running == [1, 2, 3, 4]
    eng.run_until_idle()
    assert sorted(eng.outputs) == ["r0", "r1", "r2", "r3"]
    assert eng.allocator.num_used == 0
