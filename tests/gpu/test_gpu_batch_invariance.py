"""Batch invariance of what the load benchmark serves (dummy Orpheus-3B, fp8 weights and KV cache,
the audio-only head): a request's tokens alone equal its tokens among 3, 17, 40 and 160 others
joining at different steps and among three prefilled in the same step, greedy and sampled at
temperature 0.6 (each request with its own seed: a draw must not depend on the batch either), with
a new prompt in one graph with the decode rows and apart.

Its float8 GEMMs give one row the same bits at any batch size (test_gpu_op_invariance.py); bf16
ones do not beyond a few dozen rows (test_gpu_parity.py checks bf16 up to 40 others).
"""

from __future__ import annotations

import pytest
import torch
from parity_checks import greedy_batches, greedy_setup

from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def greedy():
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head="audio", quantization="fp8")  # fmt: skip
    p.load_lm()
    return greedy_setup(p)


@pytest.mark.parametrize("temperature", [0.0, 0.6], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-graphs", "prefill-apart"])
def test_fp8_tokens_alone_equal_those_among_others(greedy, gpu_report, temperature, mixed):
    prompt, engine = greedy
    got = greedy_batches(engine, prompt, {"kv_cache_dtype": "fp8", "mixed_prefill": mixed}, temperature)
    res = gpu_report("batch-invariance-fp8")
    res.update(lm_head="audio", quantization="fp8", kv_cache_dtype="fp8")
    res.setdefault("alone_vs_batched", {})[f"temperature {temperature:g}, mixed graphs {mixed}"] = got
    assert {k: v["first_difference"] for k, v in got.items()} == dict.fromkeys(got, None)
