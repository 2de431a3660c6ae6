"""CSM through `GraphRunner` (prefill and decode graphs returning hidden states, depth graphs per
batch bucket with padded entries) generates the eager runner's frames, on CPU with the stand-ins
for FlashInfer and CUDA graphs of test_graph_runner_replays_match_eager_on_cpu; greedy and sampled,
requests joining a batch that is already decoding."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

LIMITS = dict(max_batch_size=4, max_context=200)


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("csm-tiny")


def prompts(program) -> list[Prompt]:
    out = []
    for i, (text, sp) in enumerate(
        [
            ("Hello there.", dict(temperature=0.0)),
            ("A longer sentence, to speak slowly.", dict(temperature=0.9, top_k=50, seed=5)),
            ("Yes.", dict(temperature=0.0)),
        ]
    ):
        rows = program.preprocess(text, {"voice": str(i)}).astype("<i4")
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), SamplingParams(max_tokens=len(rows) + 7, **sp)))
    return out


def test_graph_runner_frames_equal_the_eager_runner(program, graph_runner_cls):  # noqa: F811
    eager = staggered(Engine(program, GpuWorkerSettings(**LIMITS)), prompts(program))
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    assert eng.runner.forward_runner.depth is not None and eng.runner.forward_runner.depth.sizes == [1, 2, 4]
    graphs = staggered(eng, prompts(program))
    assert graphs == eager
    assert all(np.array(frames).shape == (7, 32) for frames, _ in graphs.values())
