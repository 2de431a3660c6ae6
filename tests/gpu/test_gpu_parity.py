"""The serving path against the reference on the GPU (dummy Orpheus-3B weights, bf16).

1. Teacher-forced logits: the serving path (fused kernels + FlashInfer + CUDA graphs) against the
   eager runner with the same fused weights, and against the eager reference path (unfused, HF
   arithmetic, torch paged attention); with VOXPIPE_GPU_CPU_FP32=1 also against the CPU torch
   backend in fp32 with the same weights (minutes on the CPU).
2. Prefill graphs (prefill_checks.py): logits and KV pages against eager FlashInfer prefill for
   several prompt lengths and request mixes, and steps mixing prefill and decode rows.
3. Greedy tokens of a request alone and among 3, 17 and 40 others and three in one step (graphs on):
   with the decode GEMMs in row tiles in every batch, as one GEMM in the batches this GPU's bf16
   GEMMs keep row-invariant.
4. Codec graphs against the eager codec.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from parity_checks import (
    VARIANTS,
    codec_graphs_vs_eager,
    forced_batches,
    greedy_batches,
    greedy_graphs_vs_eager,
    greedy_setup,
    run_forced,
)
from prefill_checks import TOLERANCE, compare, prefill_checks

from bench.op_invariance import GEMMS, gemm_checks
from common.config import GpuWorkerSettings
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.graphs import bucket_for, decode_buckets
from gpu_worker.runner.kv_cache import allocate_kv_cache
from gpu_worker.runner.model_runner import make_runner
from programs import get_spec, load_program_class
from programs.blocks import fp8
from programs.orpheus.model import LlamaLM

PAGE = 16
BUCKETS = decode_buckets(256)  # the decode graphs of the greedy checks' engines (parity_checks.greedy_setup)


@pytest.fixture(scope="module")
def fast():
    """The serving program: dummy Orpheus-3B, bf16, fused on CUDA."""
    p = load_program_class("orpheus")(
        get_spec("orpheus"), load_format="dummy", device="cuda", dtype=torch.bfloat16
    )
    p.load_lm()
    assert p.lm.fused
    return p


def kv(program, dtype=torch.bfloat16, device="cuda"):
    return allocate_kv_cache(
        program.num_layers, 64, PAGE, program.num_kv_heads, program.head_dim, dtype, device
    )


def test_graph_logits_match_eager_and_the_unfused_reference(fast, gpu_report):
    res = gpu_report("parity")
    ref = load_program_class("orpheus")(
        get_spec("orpheus"), load_format="dummy", device="cuda", dtype=torch.bfloat16
    )
    ref.lm = LlamaLM.dummy(fast.lm.config, torch.bfloat16, "cuda")  # same seed → same weights, unfused
    assert not ref.lm.fused
    rng = np.random.default_rng(0)
    prompts = [
        ref.preprocess(t, {}).reshape(-1)
        for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    seqs = [
        np.concatenate([p, rng.integers(128266, 128266 + 7 * 4096, size=48)]).astype(np.int64)
        for p in prompts
    ]
    steps = forced_batches(seqs, [len(p) for p in prompts])
    graph_logits = run_forced(
        make_runner(fast, kv(fast), GpuWorkerSettings(max_batch_size=8, max_context=1200)), steps
    )
    eager_fast = run_forced(
        make_runner(fast, kv(fast), GpuWorkerSettings(max_batch_size=8, cuda_graphs=False)), steps
    )
    reference = run_forced(EagerRunner(ref, TorchPagedAttention(kv(ref), ref.num_qo_heads)), steps)
    res["graph_vs_eager_fused"] = compare(graph_logits, eager_fast)
    res["graph_vs_reference_bf16"] = compare(graph_logits, reference)
    if os.environ.get("VOXPIPE_GPU_CPU_FP32") == "1":
        cpu = load_program_class("orpheus")(
            get_spec("orpheus"), load_format="dummy", device="cpu", dtype=torch.float32
        )
        sd = {k: v.float().cpu() for k, v in ref.lm.state_dict().items()}
        cpu.lm = LlamaLM.from_state_dict(ref.lm.config, sd, torch.float32, "cpu")
        cpu_kv = kv(cpu, torch.float32, "cpu")
        cpu_logits = run_forced(EagerRunner(cpu, TorchPagedAttention(cpu_kv, cpu.num_qo_heads)), steps[:9])
        res["graph_vs_cpu_fp32"] = compare(graph_logits[:9], cpu_logits)
        res["reference_bf16_vs_cpu_fp32"] = compare(reference[:9], cpu_logits)
    del ref
    torch.cuda.empty_cache()
    # Not bitwise: a padded prefill rounds its bf16 GEMMs otherwise (TOLERANCE).
    assert res["graph_vs_eager_fused"]["max_abs"] < TOLERANCE
    assert res["graph_vs_reference_bf16"]["max_abs"] < 0.5
    if "graph_vs_cpu_fp32" in res:
        # Random-weight logits are nearly tied everywhere, so bf16 rounding alone flips argmaxes (the
        # unfused bf16 reference agrees with fp32 no better); the bar is being as close to fp32 as it.
        assert res["graph_vs_cpu_fp32"]["max_abs"] <= 1.25 * res["reference_bf16_vs_cpu_fp32"]["max_abs"]


def test_prefill_graphs_match_eager_prefill(fast, gpu_report):
    res, ok = prefill_checks(fast, PAGE)
    gpu_report("parity")["prefill_graphs"] = res
    assert ok, res


@pytest.fixture(scope="module")
def greedy(fast):
    return greedy_setup(fast)


def bf16_rows_kept(program) -> int:
    """The most decode rows at which this GPU's bf16 GEMMs of the served shapes (the backbone's
    projections and the full head) still give a row the bits it gets alone: the bucket below the
    first that rounds it otherwise (`bench.op_invariance`: the O projection on the H200 from 56
    rows; the down projection on an H100 from 16). The GEMM library picks its kernel by the row
    count, so that bound is the GPU's."""
    # (the head rounded to fp8 GEMMs' multiple of 16 rows: gemm_checks times those too)
    shapes = (*GEMMS[:4], ("head", program.lm.vocab_size // 16 * 16, program.lm.hidden_size))
    firsts = [v["bf16"] for v in gemm_checks("cuda", BUCKETS, shapes).values() if v["bf16"] is not None]
    torch.cuda.empty_cache()  # its weights' memory back before the engines size their KV caches
    first = min(firsts, default=None)
    return BUCKETS[-1] if first is None else max(b for b in BUCKETS if b < first)


# Two engines capture their graphs (three, and an eager one, with a report), then five runs of 279
# steps each: that may take more than the suite's 300 s. The thread method, as conftest.py gives the rest.
@pytest.mark.timeout(600, method="thread")
def test_greedy_tokens_alone_equal_those_among_others(fast, greedy, gpu_report):
    """bf16 weights: a request's greedy tokens alone, among 3, 17 and 40 others and three in one
    step. With the decode graphs' GEMMs in tiles of 64 rows (`--decode-row-tile 64`) or every GEMM
    in the row-invariant kernel (`--invariant-gemm on`) they are the same in every one on any GPU;
    as one cuBLAS GEMM a projection, in those whose batch this GPU's bf16 GEMMs keep row-invariant
    (`bf16_rows_kept`). fp8 weights keep every batch (test_gpu_batch_invariance.py)."""
    prompt, engine = greedy
    res = gpu_report("parity")
    report = bool(os.environ.get("VOXPIPE_GPU_REPORT_DIR"))
    kept = res["bf16_rows_kept"] = bf16_rows_kept(fast)
    res["greedy_alone_vs_batched"] = {}
    variants = {
        "default (no split-KV)": {},
        "row tiles of 64": {"decode_row_tile": 64},
        "invariant GEMM": {"invariant_gemm": "on"},
        **VARIANTS,
    }
    try:
        for name, kw in variants.items():
            if name != "split-KV allowed" or report:  # split-KV: information for the report
                res["greedy_alone_vs_batched"][name] = greedy_batches(engine, prompt, kw, others=(3, 17, 40))
    finally:
        fp8.use_invariant_gemm(False)
    if report:  # information: a padded prefill may round otherwise
        res["greedy_alone_graphs_vs_eager"] = greedy_graphs_vs_eager(engine, prompt)
    for name in ("row tiles of 64", "invariant GEMM"):
        got = res["greedy_alone_vs_batched"][name]
        assert {k: v["first_difference"] for k, v in got.items()} == dict.fromkeys(got, None), name
    got = {
        k: v["first_difference"]
        for k, v in res["greedy_alone_vs_batched"]["default (no split-KV)"].items()
        if bucket_for(BUCKETS, 4 if k == "3_same_step" else int(k) + 1) <= kept
    }
    assert got and got == dict.fromkeys(got, None)


def test_codec_graphs_match_the_eager_codec(fast, gpu_report):
    fast.load_codec()
    rng = np.random.default_rng(0)
    codes = rng.integers(1, 4096, size=(40, 28))
    tokens = (codes + 128266 + 4096 * (np.arange(28) % 7)).astype(np.int64)[:, :, None]
    res = codec_graphs_vs_eager(fast, tokens, rng.integers(0, 2**62, size=40), 64)
    gpu_report("parity")["codec_graph_vs_eager"] = res
    assert res["max_pcm_diff"] <= 1 and res["valid_equal"], res
