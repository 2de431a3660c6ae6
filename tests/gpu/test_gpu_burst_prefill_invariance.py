"""A burst through the batched prefill graphs (gpu_worker/runner/batched_prefill.py) on the GPU:
dummy Orpheus-3B with float8 weights and KV cache, the audio-only head; 12 requests arrive at once
and 4 more two steps later (prompts of the 32- and 64-row buckets), several of them starting together in one batched graph
or joining a step's first prompt in its mixed graph with the decode rows, and each generates the
tokens it generates alone, greedy and sampled (its own seed). With `--max-prefills 16` the batched
graphs take up to 16 prompts: 24 of the 32-row bucket arrive at once, so that a graph of more than
the default 8 runs. The same burst with bf16 weights whose GEMMs run in the row-invariant kernel
(`--invariant-gemm on`, which turns the batched graphs on for them). Also records how many steps
the burst took to start and the batched and mixed graphs replayed."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from parity_checks import greedy_setup

from programs import get_spec, load_program_class
from programs.blocks import fp8

TEXTS = [
    "The same words, again.",
    "Please remember to bring your ticket and your passport to the station tomorrow morning.",
    "Yes.",
    "Could you tell me where the old library is in this town, and when it opens?",
    "A short sentence.",
    "Every morning I make coffee and listen to the radio before work, then walk to the office.",
    "Thank you so much for coming today.",
    "She said it would be a long night, but nobody wanted to leave the warm kitchen.",
]


def orpheus(quantization: str):
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head="audio", quantization=quantization)  # fmt: skip
    p.load_lm()
    return p


@pytest.fixture(scope="module")
def greedy():
    return greedy_setup(orpheus("fp8"))


@pytest.mark.parametrize("temperature", [0.0, 0.6], ids=["greedy", "sampled"])
@pytest.mark.parametrize("max_prefills", [0, 16], ids=["default", "max-prefills-16"])
def test_a_burst_started_in_batched_graphs_samples_what_each_request_samples_alone(
    greedy, gpu_report, temperature, max_prefills
):
    # the serve settings of the program's weights (the runner reads float8 from the program itself)
    kw = {"kv_cache_dtype": "fp8", "quantization": "fp8", "max_prefills": max_prefills}
    burst(greedy, kw, gpu_report, temperature, max_prefills, "")


@pytest.fixture(scope="module")
def bf16():
    """bf16 weights; its engines turn the row-invariant kernel on (process-wide), off at the end."""
    yield greedy_setup(orpheus("none"))
    fp8.use_invariant_gemm(False)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("temperature", [0.0, 0.6], ids=["greedy", "sampled"])
def test_with_the_invariant_gemm_a_bf16_burst_samples_what_each_request_samples_alone(
    bf16, gpu_report, temperature
):
    burst(bf16, {"kv_cache_dtype": "fp8", "invariant_gemm": "on"}, gpu_report, temperature, 0, "bf16, ")


def burst(greedy, kw: dict, gpu_report, temperature: float, max_prefills: int, label: str) -> None:
    prompt, engine = greedy
    # with --max-prefills 16 the burst's prompts share one bucket (the short texts), so that one
    # batched graph takes all but the step's first
    at_once, stride = (24, 2) if max_prefills else (12, 1)
    texts = [TEXTS[(stride * i if i < at_once else i) % len(TEXTS)] for i in range(at_once + 4)]
    prompts = [prompt(f"r{i}", text, 10 + i, 200, temperature) for i, text in enumerate(texts)]
    alone = {}
    for p in prompts:
        eng = engine(**kw)
        eng.add(p)
        eng.run_until_idle()
        alone[p.rid] = eng.outputs[p.rid][0]
    eng = engine(**kw)
    runner = eng.runner.forward_runner
    assert runner.batched is not None, "row-invariant GEMMs: batched prefill graphs are captured"
    replayed, graphs = [], [*runner.batched.graphs.items(), *runner.mixed.items()]
    for key, (graph, _) in graphs:
        graph.replay = lambda key=key, replay=graph.replay: replayed.append(key) or replay()
    for p in prompts[:at_once]:
        eng.add(p)
    steps, t0 = 0, time.perf_counter()
    while eng.waiting or steps < 2:
        eng.step()
        steps += 1
        if steps == 2:  # four more while the first ones decode: they join a step's first prompt
            for p in prompts[at_once:]:
                eng.add(p)
    torch.cuda.synchronize()
    admit_ms = 1000 * (time.perf_counter() - t0)
    eng.run_until_idle()
    differ = {
        rid: next((i for i, (a, b) in enumerate(zip(eng.outputs[rid][0], want, strict=True)) if a != b), None)
        for rid, want in alone.items()
    }
    res = gpu_report("burst-prefill-invariance")
    res.setdefault("bursts", {})[f"{label}temperature {temperature:g}, max_prefills {max_prefills}"] = {
        "requests": len(prompts), "rows": sorted({p.n_rows for p in prompts}), "steps_to_start": steps,
        "start_ms": round(admit_ms, 1), "batched_graphs_replayed": [list(k) for k in replayed if len(k) == 2],
        "mixed_graphs_replayed": [list(k) for k in replayed if len(k) == 3], "first_difference": differ,
    }  # fmt: skip
    for _, (graph, _) in graphs:
        vars(graph).pop("replay", None)  # the class's own again (the engine serves the next test)
    assert any(len(k) == 2 for k in replayed), "several prompts of one bucket started in a batched graph"
    assert any(len(k) == 3 and k[2] > 1 for k in replayed), "prompts joined a step's first in a mixed graph"
    assert steps < len(prompts), "the burst started several prompts a step"
    if max_prefills:
        assert any(len(k) == 2 and k[0] > 8 for k in replayed), "a batched graph of more than 8 prompts ran"
    assert differ == dict.fromkeys(alone, None)


def test_a_step_starting_prompts_out_of_request_order_launches_without_waiting_for_the_device(greedy):
    """A step whose prompts of two buckets run in two batched graphs (their outputs out of request
    order, gathered back) is laid out, planned and launched without one host-device synchronization
    (torch's sync debug mode raises at a blocking copy, an `.item()`...): the host lays out the next
    step while the device runs this one. Its requests' slots (sampling settings, XQA page rows) are
    written together, and each request generates the tokens it generates alone."""
    from gpu_worker.runner import graphs as graphs_module

    prompt, engine = greedy
    eng = engine(kv_cache_dtype="fp8", quantization="fp8", max_prefills=0)  # the burst test's engine
    # 32- and 64-row buckets in turn; max_tokens counts the prompt's tokens too
    prompts = [prompt(f"r{i}", text, 10 + i, 90) for i, text in enumerate(TEXTS)]
    alone = {}
    for p in prompts:
        eng.add(p)
        eng.run_until_idle()
        alone[p.rid] = eng.outputs[p.rid][0]
    runner = eng.runner.forward_runner
    gathered = []

    def in_order(parts):
        ix = [i for part, _, _ in parts for i in part]
        gathered.append(ix != sorted(ix))
        return order(parts)

    def forward(b):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(b)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    order, launch = graphs_module.in_request_order, runner.forward
    graphs_module.in_request_order, runner.forward = in_order, forward
    try:
        eng.add(prompt("first", TEXTS[0], 1, 90))
        eng.step()  # a decoding stream for the burst's step to join
        for p in prompts:
            eng.add(p)
        while eng.waiting or any(r.n_ctx == 0 for r in eng.running.values()):
            eng.step()
    finally:
        graphs_module.in_request_order = order
        vars(runner).pop("forward", None)
    eng.run_until_idle()
    assert any(gathered), "a step's prefill outputs came out of request order"
    assert {p.rid: eng.outputs[p.rid][0] for p in prompts} == alone
