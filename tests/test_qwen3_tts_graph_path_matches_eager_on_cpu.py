"""Qwen3-TTS through `GraphRunner` (prefill, decode and mixed graphs reading each row's slot and step
from the input arena, code-predictor graphs per batch bucket) generates the eager runner's frames,
on CPU with the stand-ins for FlashInfer and CUDA graphs of
test_graph_runner_replays_match_eager_on_cpu: greedy and sampled, both text modes (the streaming
one reads its text from the per-request state), requests joining a batch already decoding."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)
from tokenizer_worker.worker import wire_array

LIMITS = dict(max_batch_size=4, max_context=200)


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("qwen3-tts-tiny")


def prompts(program) -> list[Prompt]:
    out = []
    for i, (text, options, sp) in enumerate(
        [
            ("Hello there.", {"non_streaming_mode": "false"}, dict(temperature=0.0)),
            (
                "A longer sentence, to speak slowly.",
                {"voice": "ryan"},
                dict(temperature=0.9, top_k=50, seed=5),
            ),
            ("Yes, that is right.", {"non_streaming_mode": "false"}, dict(temperature=0.9, seed=9)),
        ]
    ):
        built = program.preprocess(text, options)
        rows = built.rows.astype("<i4")
        state = {k: wire_array(v) for k, v in built.state.items()}
        sampling = SamplingParams(max_tokens=len(rows) + 7, repetition_penalty=1.05, **sp)
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sampling, state=state))
    return out


def test_graph_runner_frames_equal_the_eager_runner(program, graph_runner_cls):  # noqa: F811
    eager = staggered(Engine(program, GpuWorkerSettings(**LIMITS)), prompts(program))
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    mixed = []  # a prompt riding in one graph with the decode rows (program.mixed_prefill)
    for key, (graph, _) in eng.runner.forward_runner.mixed.items():
        graph.replay = lambda key=key, replay=graph.replay: mixed.append(key) or replay()
    graphs = staggered(eng, prompts(program))
    assert graphs == eager
    assert mixed, "no request joined the decoding batch in a mixed graph"
    assert all(np.array(frames).shape == (7, 16) for frames, _ in graphs.values())
