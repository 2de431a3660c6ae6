"""The operations the engine relies on to give a row the same bits at any batch size, on the GPU
(`voxpipe bench op-invariance` reports every operation's first batch-variant size; its detector is
tested on the CPU in tests/test_op_invariance_bench.py):

- every float8 GEMM of Orpheus-3B (and its audio head) alone and as one GEMM over a mixed step's
  prompt and decode rows, and the same bf16 GEMMs in the row-invariant Triton kernel
  (`--invariant-gemm on`), within bf16 rounding of cuBLAS's, and each way's time (reported);
- decode attention as the engine runs it: FlashInfer without split-KV over a bf16 cache, XQA told
  one SM over an fp8 cache;
- the sampler's softmax.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.op_invariance import (
    GEMMS,
    attention_checks,
    gemm_checks,
    gemm_times,
    mixed_checks,
    sampling_checks,
)
from gpu_worker.runner.graphs import decode_buckets
from programs.blocks import fp8


@pytest.fixture(scope="module")
def sizes() -> list[int]:
    # Dynamo keys its compiled quantizers on the function's code, and engines built by the tests
    # before this module compiled it for their own widths: start from none, as a server process does.
    torch._dynamo.reset()
    fp8.compile_quantizer(torch.device("cuda"), tuple(sorted({k for _, _, k in GEMMS})))
    return decode_buckets(512)


@pytest.fixture(scope="module")
def gemms(sizes, gpu_report) -> dict:
    res = gpu_report("op-invariance")
    res["sizes"] = sizes
    res["gemm"] = gemm_checks("cuda", sizes)
    res["mixed_gemm"] = mixed_checks("cuda", sizes)
    return res


@pytest.mark.parametrize("kind", ["fp8", "bf16_invariant"])
def test_gemms_of_this_kind_give_a_row_the_same_bits_at_any_batch(gemms, kind):
    assert {name: v[kind] for name, v in gemms["gemm"].items()} == dict.fromkeys(gemms["gemm"], None)
    assert {name: v[kind] for name, v in gemms["mixed_gemm"].items()} == dict.fromkeys(
        gemms["mixed_gemm"], None
    )


def test_the_invariant_gemms_tile_width_leaves_a_rows_bits(gpu_report):
    """`invariant_gemm.block_n` widens the tile with the row count (beyond the sizes the test above
    takes, to 128 past 512 rows): every width gives every row of the served shapes the same bits."""
    from programs.blocks import invariant_gemm

    g = torch.Generator(device="cuda").manual_seed(4)
    differ = {}
    for name, n, k in GEMMS:
        w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
        x = torch.randn(640, k, generator=g, device="cuda").to(torch.bfloat16)
        outs = {bn: invariant_gemm.linear(x, w, tile_n=bn) for bn in (16, 32, 64, 128)}
        differ[name] = [
            bn for bn, o in outs.items() if not torch.equal(o.view(torch.uint8), outs[16].view(torch.uint8))
        ]
    gpu_report("op-invariance")["invariant_gemm_widths_differing_from_16"] = differ
    assert differ == {name: [] for name, _, _ in GEMMS}, differ


def test_the_invariant_gemm_rounds_as_cublas_does_within_bf16_and_its_time_is_reported(gpu_report):
    from programs.blocks import invariant_gemm

    g = torch.Generator(device="cuda").manual_seed(3)
    worst = {}
    for name, n, k in GEMMS:
        w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
        x = torch.randn(384, k, generator=g, device="cuda").to(torch.bfloat16)
        exact = x.double() @ w.double().T
        ours = (invariant_gemm.linear(x, w).double() - exact).abs().max().item()
        cublas = (F.linear(x, w).double() - exact).abs().max().item()
        worst[name] = {"invariant_max_abs": ours, "cublas_max_abs": cublas}
    res = gpu_report("op-invariance")
    res["invariant_gemm_vs_float64"] = worst
    res["gemm_ms"] = gemm_times()
    # both round a float32 sum to bf16 once: within a bf16 step of the exact product where cuBLAS is
    assert all(v["invariant_max_abs"] <= 2 * v["cublas_max_abs"] + 1e-6 for v in worst.values()), worst


def test_decode_attention_gives_a_row_the_same_bits_at_any_batch(sizes, gpu_report):
    res = gpu_report("op-invariance")
    res["attention"] = attention_checks(sizes)
    assert res["attention"] == dict.fromkeys(res["attention"], None)


def test_the_samplers_softmax_and_running_sums_give_a_row_the_same_bits_at_any_batch(sizes, gpu_report):
    res = gpu_report("op-invariance")
    res["sampling"] = sampling_checks("cuda", sizes)
    for op in ("softmax", "fixed_mass_cumsum"):
        assert {name: v[op] for name, v in res["sampling"].items()} == dict.fromkeys(res["sampling"], None)
