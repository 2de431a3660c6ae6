"""The operations the engine relies on to give a row the same bits at any batch size, on the GPU
(`voxpipe bench op-invariance` reports every operation's first batch-variant size; its detector is
tested on the CPU in tests/test_op_invariance_bench.py):

- every float8 GEMM of Orpheus-3B (and its audio head) alone and as one GEMM over a mixed step's
  prompt and decode rows;
- decode attention as the engine runs it: FlashInfer without split-KV over a bf16 cache, XQA told
  one SM over an fp8 cache;
- the sampler's softmax.
"""

from __future__ import annotations

import pytest
import torch

from bench.op_invariance import GEMMS, attention_checks, gemm_checks, mixed_checks, sampling_checks
from gpu_worker.runner.graphs import decode_buckets
from programs.blocks import fp8


@pytest.fixture(scope="module")
def sizes() -> list[int]:
    # Dynamo keys its compiled quantizers on the function's code, and engines built by the tests
    # before this module compiled it for their own widths: start from none, as a server process does.
    torch._dynamo.reset()
    fp8.compile_quantizer(torch.device("cuda"), tuple(sorted({k for _, _, k in GEMMS})))
    return decode_buckets(512)


def test_fp8_gemms_give_a_row_the_same_bits_at_any_batch(sizes, gpu_report):
    res = gpu_report("op-invariance")
    res["sizes"] = sizes
    res["gemm"] = gemm_checks("cuda", sizes)
    res["mixed_gemm"] = mixed_checks("cuda", sizes)
    assert {name: v["fp8"] for name, v in res["gemm"].items()} == dict.fromkeys(res["gemm"], None)
    assert {name: v["fp8"] for name, v in res["mixed_gemm"].items()} == dict.fromkeys(res["mixed_gemm"], None)


def test_decode_attention_gives_a_row_the_same_bits_at_any_batch(sizes, gpu_report):
    res = gpu_report("op-invariance")
    res["attention"] = attention_checks(sizes)
    assert res["attention"] == dict.fromkeys(res["attention"], None)


def test_the_samplers_softmax_and_running_sums_give_a_row_the_same_bits_at_any_batch(sizes, gpu_report):
    res = gpu_report("op-invariance")
    res["sampling"] = sampling_checks("cuda", sizes)
    for op in ("softmax", "fixed_mass_cumsum"):
        assert {name: v[op] for name, v in res["sampling"].items()} == dict.fromkeys(res["sampling"], None)
