"""Qwen3-TTS Base through `GraphRunner` (prefill, decode and mixed graphs) generates the eager
runner's frames, on CPU with the stand-ins for FlashInfer and CUDA graphs of
test_graph_runner_replays_match_eager_on_cpu: cloned prompts whose speaker rows and clip frame rows
read each request's speaker vector and clip frames from per-request state inside the captured step,
ICL and x-vector-only, requests with different voices joining a batch already decoding. Sampled
requests draw from the top 50 (the model's default): over all 2048 near-uniform codes of random
weights a draw can flip on CPU matmul rounding, which differs between batch shapes."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs.base import Reference, Voice
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)
from tokenizer_worker.worker import wire_array

LIMITS = dict(max_batch_size=4, max_context=200)


@pytest.fixture(scope="module")
def program():
    for p in tiny_lm_on_one_thread("qwen3-tts-base-tiny"):
        p.load_encoders()
        yield p


def prompts(program) -> list[Prompt]:
    g = np.random.default_rng(0)
    clips = [
        Reference((0.3 * g.standard_normal(n)).astype(np.float32), t)
        for n, t in ((9000, "Yes."), (30000, "It rains."))
    ]
    voices = [Voice(f, c.text) for f, c in zip(program.encode_references(clips), clips, strict=True)]
    out = []
    for i, (text, voice, options, sp) in enumerate(
        [
            ("Hello there, how are you today?", 0, {}, dict(temperature=0.0)),
            (
                "A longer sentence.",
                1,
                {"non_streaming_mode": "true"},
                dict(temperature=0.9, top_k=50, seed=5),
            ),
            (
                "Yes, that is right.",
                1,
                {"x_vector_only_mode": "true"},
                dict(temperature=0.9, top_k=50, seed=9),
            ),
            ("Fine.", 0, {}, dict(temperature=0.9, top_k=50, seed=3)),
        ]
    ):
        built = program.preprocess(text, options, voices[voice])
        rows = built.rows.astype("<i4")
        state = {k: wire_array(v) for k, v in built.state.items()}
        sampling = SamplingParams(max_tokens=len(rows) + 7, repetition_penalty=1.05, **sp)
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sampling, state=state))
    return out


def test_graph_runner_frames_equal_the_eager_runner(program, graph_runner_cls):  # noqa: F811
    eager = staggered(Engine(program, GpuWorkerSettings(**LIMITS)), prompts(program))
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    graphs = staggered(eng, prompts(program))
    assert graphs == eager
    assert all(np.array(frames).shape == (7, 16) for frames, _ in graphs.values())
