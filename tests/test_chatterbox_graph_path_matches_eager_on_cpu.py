"""Chatterbox through `GraphRunner`, each request as two KV sequences (programs.base: Classifier-free
guidance): decode graphs of bucket B holding 2B sequence rows and pairing them with `guide` inside
the graph, prefill graphs holding a prompt's two sequences, the sampling graphs reading the paired
logits, and the attention backends' pages per sequence (XQA's table rows at slot·2 + s) generate
the eager runner's speech tokens, on CPU with the stand-ins for FlashInfer and CUDA graphs of
test_graph_runner_replays_match_eager_on_cpu: greedy and sampled, different guidance weights (so a
wrong pairing changes the tokens), requests joining a batch already decoding. Also with the
prompts run eagerly beside the decode graph (the runner's fallback, its slots for `guide` read from
the rows), and in mixed prefill+decode graphs (the flag set on the tiny program: Chatterbox keeps
mixed graphs off, the runner's pairing in them is checked here)."""

from __future__ import annotations

import pytest
import torch

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs.chatterbox import spec as c
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

LIMITS = dict(max_batch_size=4, max_context=160)
NEW = 24


@pytest.fixture(scope="module")
def program():
    for p in tiny_lm_on_one_thread("chatterbox-tiny"):
        with torch.no_grad():  # the stop row scaled up: random weights then end some utterances
            p.lm.speech_head.weight[c.STOP_SPEECH] *= 2.5
        yield p


def prompts(program) -> list[Prompt]:
    out = []
    for i, (text, options, sp) in enumerate(
        [
            ("Hello there.", {"cfg_weight": "0.5"}, dict(temperature=0.0, min_tokens=10)),
            ("A longer sentence, to speak slowly.", {"cfg_weight": "1.5"}, dict(temperature=0.8, seed=5)),
            (
                "Yes, that is right.",
                {"cfg_weight": "0.9", "exaggeration": "0.8"},
                dict(temperature=0.0, min_tokens=6),
            ),
            ("One more.", {"cfg_weight": "2.0"}, dict(temperature=0.9, top_p=0.9, seed=9)),
        ]
    ):
        built = program.preprocess(text, options)
        rows = built.rows.astype("<i4")
        state = {k: wire_array(v) for k, v in built.state.items()}
        sampling = SamplingParams(max_tokens=len(rows) // 2 + NEW, repetition_penalty=1.2, **sp)
        out.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sampling, state=state))
    return out


def run_graphs(program, graph_runner_cls, limits: dict, every: int = 0) -> dict:  # noqa: F811
    """The staggered prompts through an engine on the graph runner, with its sampling graphs."""
    eng = graph_engine(program, graph_runner_cls, limits)
    eng.runner.capture_sampling()
    return staggered(eng, prompts(program), every)


@pytest.fixture(scope="module")
def eager(program) -> dict:
    return staggered(Engine(program, GpuWorkerSettings(**LIMITS)), prompts(program))


def test_guided_graphs_give_the_eager_tokens(program, graph_runner_cls, eager):  # noqa: F811
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    runner = eng.runner.forward_runner
    assert runner.sequences == 2 and runner.sizes == [1, 2, 4]
    assert runner.arena.spans["pos"][1] == 8 and runner.arena.spans["meta"][1] == 12  # 2 rows a request
    assert all(reqs == 2 for _, reqs in runner.prefill.buckets)  # a prompt's two sequences
    replays = []
    for bs, (graph, _, _) in runner.graphs.items():
        graph.replay = lambda bs=bs, replay=graph.replay: replays.append(bs) or replay()
    eng.runner.capture_sampling()
    sampled, replay = [], eng.runner.sample_graphs.replay
    eng.runner.sample_graphs.replay = lambda bs, constrained: sampled.append(bs) or replay(bs, constrained)
    graphs = staggered(eng, prompts(program))
    assert graphs == eager
    assert {1, 2, 4} <= set(replays)  # every decode bucket ran
    assert {1, 2, 4} <= set(sampled)  # and sampled its paired logits in its sampling graph
    assert any(reason == FinishReason.STOP for _, reason in graphs.values())
    assert any(reason == FinishReason.LENGTH for _, reason in graphs.values())


def test_guided_prompts_run_eagerly_beside_decode_graphs(program, graph_runner_cls, eager):  # noqa: F811
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph_runner_cls, "place", lambda self, rows, decoding=True: None)  # no prompt in a graph
        assert run_graphs(program, graph_runner_cls, LIMITS) == eager


def test_guided_prompts_in_mixed_graphs(program, graph_runner_cls, eager):  # noqa: F811
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(program, "mixed_prefill", True, raising=False)
        eng = graph_engine(program, graph_runner_cls, LIMITS)
        runner = eng.runner.forward_runner
        assert runner.mixed
        mixed = []
        for key, (graph, _) in runner.mixed.items():
            graph.replay = lambda key=key, replay=graph.replay: mixed.append(key) or replay()
        eng.runner.capture_sampling()
        assert staggered(eng, prompts(program)) == eager
    assert mixed, "prompts joined decode steps in mixed graphs"


def test_startup_timing_steps_run_as_guided_steps(program, graph_runner_cls):  # noqa: F811
    """The engine's startup steps (gpu_worker/scheduler/calibrate.py, laid out one sequence a
    request) run both sequences of each request: the captured wrappers take only their own
    row counts, so a decode graph planned with one row a request would fail here."""
    from gpu_worker.scheduler.calibrate import step_differences

    eng = graph_engine(program, graph_runner_cls, LIMITS)
    runner, shapes = eng.runner.forward_runner, []

    def timer(r, b) -> float:
        logits, _, _ = r.forward(b)
        shapes.append((b.batch_size, logits.shape[0]))
        return float(b.batch_size)

    diffs = step_differences(runner, eng.runner.num_pages, 16, LIMITS["max_context"], 1, timer=timer)
    assert diffs and shapes and all(n == got for n, got in shapes)  # a row of logits per request


def test_graphs_refuse_state_another_engine_allocated_again(program, graph_runner_cls, eager):  # noqa: F811
    """The graphs read the per-request state (`init_state`'s buffers: conditioning rows, guidance
    weights, text ends) that the program held at their capture, as CUDA graphs read the addresses
    they were captured with (the stand-in's replays too). An engine built later on the same program
    allocates new buffers, which `admit` then writes: the graph engine's tokens would come from
    stale state (zeros here), so its next admission is refused; built last, it gives the eager
    tokens while the eager engine shares its buffers."""
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    Engine(program, GpuWorkerSettings(**LIMITS))
    eng.add(prompts(program)[0])
    with pytest.raises(RuntimeError, match="init_state"):
        eng.step()
    late = Engine(program, GpuWorkerSettings(**LIMITS))
    assert staggered(graph_engine(program, graph_runner_cls, LIMITS), prompts(program)) == eager
    assert staggered(late, prompts(program)) == eager
