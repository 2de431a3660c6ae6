"""Higgs Audio v2 through `GraphRunner` (prefill, decode and mixed graphs reading each row's slot and
step from the input arena, the DualFFN flag that `embed` leaves for `backbone` inside each graph,
`decode_tokens` graphs per batch bucket with the delay pattern's forced ids) generates the eager
runner's rows, on CPU with the stand-ins for FlashInfer and CUDA graphs of
test_graph_runner_replays_match_eager_on_cpu: greedy and sampled, requests joining a batch already
decoding, through the delay pattern's bos rows, an eos countdown, the flush rows and the stop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs.higgs_tts import spec as h
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

LIMITS = dict(max_batch_size=4, max_context=300)
NEW = 60


@pytest.fixture(scope="module")
def program():
    for p in tiny_lm_on_one_thread("higgs-tts-tiny"):
        with torch.no_grad():  # eos rows of the audio head scaled up: random weights then end utterances
            p.lm.audio_lm_head.weight.view(h.N_CODEBOOKS, h.CODEBOOK_IDS, -1)[:, h.STREAM_EOS] *= 1.6
        yield p


def prompts(program) -> list[Prompt]:
    out = []
    for i, (text, sp) in enumerate(
        [
            ("Hello there.", dict(temperature=0.0)),
            ("A longer sentence, to speak slowly.", dict(temperature=0.9, top_k=50, seed=5)),
            ("Yes, that is right.", dict(temperature=0.8, top_p=0.9, seed=9)),
        ]
    ):
        rows = program.preprocess(text, {}).rows.astype("<i4")
        out.append(
            Prompt(f"r{i}", rows.tobytes(), len(rows), SamplingParams(max_tokens=len(rows) + NEW, **sp))
        )
    return out


def test_graph_runner_rows_equal_the_eager_runner(program, graph_runner_cls):  # noqa: F811
    eager = staggered(Engine(program, GpuWorkerSettings(**LIMITS)), prompts(program))
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    graphs = staggered(eng, prompts(program))
    assert graphs == eager
    stopped = [rows for rows, reason in graphs.values() if reason == FinishReason.STOP]
    assert stopped, "an utterance ends within the budget"
    for rows in stopped:
        assert np.array(rows)[-1, 0] == h.FLUSH_BASE + program.flush_rows - 1
