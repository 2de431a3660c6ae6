"""Sampling graphs (gpu_worker/runner/sample_graphs.py): a decode-only step whose rows share a mode replays
its bucket's captured sampling, padding rows on the scratch slot; every request still samples the
tokens of the eager engine, whatever its settings (penalty over the whole history or a window, or
none; greedy; top-k, top-p, min-p; min_tokens), with requests joining mid-stream and steps mixing
free and constrained rows (sampled eagerly). On CPU, with the stand-ins for FlashInfer and CUDA
graphs of test_graph_runner_replays_match_eager_on_cpu. Free rows sample over the audio-only head
(the H200's load runs it; sorting the full vocabulary on one CPU thread is most of a step),
constrained ones over the full head: both heads' sampling graphs are checked."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

LIMITS = dict(max_batch_size=12, max_context=120, first_chunk="reference")
SETTINGS = [
    dict(temperature=0.6, top_p=0.8, repetition_penalty=1.3, repetition_window=-1),
    dict(temperature=0.0, repetition_penalty=1.0),
    dict(temperature=1.0, top_k=50, repetition_penalty=1.5, repetition_window=8),
    dict(temperature=0.9, min_p=0.05, repetition_penalty=1.1, repetition_window=0),
    dict(temperature=0.0, repetition_penalty=1.3, repetition_window=-1),
]


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("orpheus-tiny")


@pytest.fixture(scope="module")
def audio_head_program():
    yield from tiny_lm_on_one_thread("orpheus-tiny", lm_head="audio")


def prompts(constrained: list[bool]) -> list[Prompt]:
    out = []
    for i, c in enumerate(constrained):
        rows = np.array([128259, 300 + i, 301, 302 + 3 * i, 128009, 128260, 128261, 128257], dtype="<i4")
        sp = SamplingParams(
            max_tokens=60 + 5 * i, min_tokens=40, seed=11 + i, constrained=c, **SETTINGS[i % len(SETTINGS)]
        )
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sp))
    return out


@pytest.mark.parametrize("graph_runner_cls", ["xqa"], indirect=True)  # the H200's decode path
@pytest.mark.parametrize(
    "constrained, head",
    [([False] * 7, "audio"), ([True] * 7, "full"), ([True, False, True, True, False, True, False], "audio")],
    ids=["free", "constrained", "mixed"],
)
def test_sampling_graphs_give_the_eager_tokens(request, graph_runner_cls, constrained, head):  # noqa: F811
    program = request.getfixturevalue("program" if head == "full" else "audio_head_program")
    assert (program.head_ids is None) == (head == "full")

    def engine() -> Engine:
        eng = Engine(program, GpuWorkerSettings(**LIMITS))
        eng.runner.forward_runner = graph_runner_cls(program, eng.kv_cache, GpuWorkerSettings(**LIMITS))
        return eng

    # Against the same runner sampling eagerly: the stand-in attention rounds differently from
    # the eager runner's, and over the whole vocabulary that changes a draw now and then.
    eager = staggered(engine(), prompts(constrained), every=3)
    eng = engine()
    eng.runner.capture_sampling()
    assert set(eng.runner.sample_graphs.graphs) == {
        (bs, c) for bs in eng.runner.forward_runner.sizes for c in (False, True)
    }
    replays = []
    replay = eng.runner.sample_graphs.replay
    eng.runner.sample_graphs.replay = lambda bs, c: replays.append((bs, c)) or replay(bs, c)
    got = staggered(eng, prompts(constrained), every=3)
    assert got == eager
    assert all(len(rows) >= 40 for rows, _ in got.values())
    # Decode-only steps of one mode ran in graphs, padded batches (7 of 8) among them; a mixed
    # batch only once the requests of one mode have finished.
    modes = {c for _, c in replays}
    if len(set(constrained)) == 1:
        assert modes == {constrained[0]} and len(replays) > 40 and (8, constrained[0]) in replays
    else:
        assert len(replays) < 20
    # The scratch slot's state is the padding rows' alone: no request's slot was written by them.
    assert eng.slots.scratch == LIMITS["max_batch_size"] and eng.slots.num_free == LIMITS["max_batch_size"]
