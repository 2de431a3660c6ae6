"""Chatterbox's T3 (dummy 520M weights, bf16) through CUDA graphs on the GPU: each request's two KV
sequences in the prefill and decode graphs, paired by `guide` inside them
(gpu_worker/runner/graphs.py), against the eager runner:

1. A greedy request alone: its guided logits through the graphs equal the eager engine's at every
   step whose inputs agree, within bf16's rounding of a padded prefill; its tokens equal the eager
   engine's, save from a step where the eager logits' top two lie within that step's difference (a
   near tie that rounding may flip). A sequence paired wrongly moves the logits by far more.
2. Its greedy tokens through the graphs are the same alone and among 3 and 11 others joining at
   different steps with other guidance weights (batch invariance of the paired graphs), with bf16
   weights, float8 ones, and float8 ones in 64-row tiles; against the eager engine among the same
   others (reported).
3. Decode step time at 1, 16 and 64 streams with graphs and eagerly (reported; a step holds 2
   sequences a stream).

    VOXPIPE_GPU_REPORT_DIR=out python -m pytest tests/gpu/test_gpu_chatterbox_graphs.py -s
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class

MODEL = "chatterbox"
MAX_CONTEXT = 600
TEXTS = [
    "Hello there, how are you today?",
    "The sun was low over the harbor when the boats came back.",
    "Thank you so much for coming.",
    "I think we should call them first, and then we can decide.",
]
NEW = 80  # greedy tokens compared
GREEDY = dict(temperature=0.0, repetition_penalty=1.0)  # the logits as sampled: no penalty
# of the largest logit: bf16 GEMMs of a padded prefill round otherwise, and 30 layers carry it
# (Orpheus-3B: up to 0.24 on logits of ~6, tests/gpu/prefill_checks.py)
REL_TOLERANCE = 0.05


def load(quantization: str = "none"):
    """The dummy T3 (the same seeded weights at every load) with its stand-in tokenizer and voice."""
    p = load_program_class(MODEL)(
        get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16, quantization=quantization
    )
    p.load_lm()
    p.load_prompts()
    return p


@pytest.fixture(scope="module")
def program():
    return load()


def prompt(program, rid: str, i: int, new: int, **sp) -> Prompt:
    options = {"cfg_weight": str(0.3 + 0.2 * (i % 5)), "exaggeration": str(0.4 + 0.2 * (i % 3))}
    p = program.preprocess(TEXTS[i % len(TEXTS)], options)
    rows = np.asarray(p.rows, dtype="<i4")
    state = {k: wire_array(v) for k, v in p.state.items()}
    sampling = SamplingParams(max_tokens=len(rows) // 2 + new, min_tokens=new, **sp)
    return Prompt(rid, rows.tobytes(), len(rows), sampling, state=state)


def engine(program, graphs: bool, batch: int = 16, row_tile: int = 0) -> Engine:
    limits = GpuWorkerSettings(
        max_batch_size=batch, max_context=MAX_CONTEXT, cuda_graphs=graphs, decode_row_tile=row_tile
    )
    eng = Engine(program, limits)
    assert eng.runner.has_graphs == graphs  # a guided program gets the graph runner
    return eng


@pytest.fixture(scope="module")
def engines(program) -> dict[bool, Engine]:
    """Graphs on (True) and off, reused by the runs (each run leaves its engine idle). The graph
    engine has a program of its own: its graphs read the per-request state its program held at
    capture, and an engine built later on that program would allocate it again
    (`ModelRunner.check_state`)."""
    return {True: engine(load(), True), False: engine(program, False)}


def run(eng: Engine, others: int = 0) -> list[int]:
    """The greedy request's tokens, alone or among `others` sampled requests joining at different
    steps with other guidance weights."""
    program = eng.runner.program
    crowd = [prompt(program, f"o{i}", i, NEW, temperature=0.8, seed=i) for i in range(others)]
    eng.outputs = {}
    for i, p in enumerate([*crowd[:1], prompt(program, "x", 1, NEW, **GREEDY), *crowd[1:]]):
        eng.add(p)
        for _ in range(i % 3 + 1 if others else 0):
            eng.step()
    eng.run_until_idle()
    return eng.outputs["x"][0]


def with_logits(eng: Engine, terms: list[float] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy request alone: its tokens, and the logits [V] each step gave it; into `terms` (an
    eager engine's) each step's largest guidance term |w·(cond − uncond)|, by which a dropped
    `guide` would move the logits (a swapped pair by 1 + 2w times |cond − uncond|)."""
    runner, program, seen = eng.runner.forward_runner, eng.runner.program, []
    forward, guide = runner.forward, program.guide

    def spy(b):
        out = forward(b)
        seen.append(out[0][0, 0].float().cpu())  # a copy: a graph's output is rewritten by its next replay
        return out

    def guide_spy(logits, slot):
        out = guide(logits, slot)
        terms.append((out - logits[:, 0]).abs().max().item())
        return out

    runner.forward = spy
    if terms is not None:
        program.guide = guide_spy
    try:
        return run(eng), seen
    finally:
        del runner.forward
        if terms is not None:
            del program.guide


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_guided_graph_logits_and_greedy_tokens_equal_eager(engines, gpu_report):
    terms: list[float] = []
    (tg, lg), (te, le) = with_logits(engines[True]), with_logits(engines[False], terms)
    first = first_difference(tg, te)
    same = len(tg) if first is None else first + 1  # steps whose inputs agree
    diffs = [(g - e).abs().max().item() for g, e in zip(lg[:same], le[:same], strict=True)]
    scale = max(e.abs().max().item() for e in le[:same])
    res = gpu_report("chatterbox_graphs")
    res["alone"] = {
        "tokens": len(tg),
        "first_difference": first,
        "max_logit_diff": max(diffs),
        "scale": scale,
        "guidance_term": min(terms[:same]),  # the smallest step's: what a dropped guide would move
    }
    print("chatterbox graphs vs eager, alone:", res["alone"])
    assert max(diffs) <= REL_TOLERANCE * scale, "guided logits through graphs equal eager's within bf16"
    if first is not None:  # only a near tie may flip
        e = le[first]
        res["alone"]["tie_gap"] = (e[te[first]] - e[tg[first]]).item()
        assert res["alone"]["tie_gap"] <= 2 * diffs[first], f"greedy tokens differ at {first}, no near tie"


def test_guided_graph_tokens_alone_equal_tokens_among_others(engines, gpu_report):
    """Through the graphs a request's tokens do not depend on its batch, with bf16 and with float8
    backbone weights (`--quantization fp8`): the decode graph of a bucket holds 2B rows, and T3's
    GEMMs at its shapes, its head's tiles and its norms (FlashInfer's, one row per block) give a row
    the same bits at any bucket (`bench op-invariance --model chatterbox`). The eager engine, whose
    steps mix prompt rows with decode rows, is reported against the graphs."""
    res = gpu_report("chatterbox_graphs").setdefault("among_others", {})
    alone = run(engines[True])
    for n in (3, 11):
        got, eager = run(engines[True], n), run(engines[False], n)
        res[str(n)] = {
            "bf16_first_difference": first_difference(got, alone),
            "graphs_vs_eager_first_difference": first_difference(got, eager),
        }
    # the decode graphs' GEMMs in tiles of 64 rows (--decode-row-tile 64): reported beside
    tiled = engine(load("fp8"), True, row_tile=64)
    tiled_alone = run(tiled)
    for n in (3, 11):
        res[str(n)]["fp8_row_tiles_first_difference"] = first_difference(run(tiled, n), tiled_alone)
    del tiled
    fp8_engine = engine(load("fp8"), True)
    alone = run(fp8_engine)
    for n in (3, 11):
        got = run(fp8_engine, n)
        res[str(n)]["fp8_first_difference"] = first_difference(got, alone)
    for n in (3, 11):
        for kind in ("bf16", "fp8_row_tiles", "fp8"):
            assert res[str(n)][f"{kind}_first_difference"] is None, f"{kind}: among {n} others"


def steady_step_ms(eng: Engine, steps: int = 20) -> float:
    """Wall time of a step once every request decodes (admission done, the pipeline full)."""
    while eng.scheduler.waiting or any(r.n_ctx == 0 for r in eng.scheduler.running.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / steps


def test_guided_decode_step_time_with_graphs_and_eagerly(program, gpu_report):
    times: dict[str, dict[str, float]] = {}
    for name, graphs in (("graphs", True), ("eager", False)):
        eng = engine(program, graphs, batch=64)
        for b, lo in ((1, 0), (16, 1), (64, 16)):
            for i in range(lo, b):
                eng.add(prompt(program, f"r{i}", i, 300, temperature=0.8, seed=i))
            times.setdefault(str(b), {})[name] = steady_step_ms(eng)
        del eng
    for b, t in times.items():
        t["eager_over_graphs"] = t["eager"] / t["graphs"]
        print(f"chatterbox decode step, {b} streams: graphs {t['graphs']:.2f} ms, eager {t['eager']:.2f} ms")
    gpu_report("chatterbox_graphs")["decode_step_ms"] = times
    assert times["1"]["graphs"] < times["1"]["eager"], "one stream's step is faster in graphs"
