"""What decoding on XQA changes (dummy Orpheus-3B weights, the audio-only head).

1. Teacher-forced logits of the decode steps (graphs on, two prompts, 48 forced tokens each) for
   each (cache dtype, decode attention) against FlashInfer over a bf16 cache, the serving default:
   XQA over bf16 isolates the kernel, FlashInfer over fp8 the cache's rounding, XQA over fp8 both
   plus its fp8 attention math. Reported, not asserted: these are rounding distances.
2. Greedy tokens of a request alone and among 3, 17 and 40 others, per setting (the engine path:
   page tables per slot, gathered per step): equal. The weights are bf16, whose GEMMs round a row
   by the batch from a row count that depends on the GPU (on an H100 from 16 rows: tokens among 17
   others part from the first decode token), so the decode graphs run them in tiles of 64 rows
   (`--decode-row-tile 64`): what is compared is the attention kernels and the cache's dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_checks import forced_batches, greedy_batches, greedy_setup, run_forced
from prefill_checks import compare

from common.config import GpuWorkerSettings
from gpu_worker.runner.kv_cache import allocate_kv_cache
from gpu_worker.runner.kv_cache import kv_cache_dtype as kv_dtype
from gpu_worker.runner.model_runner import make_runner
from programs import get_spec, load_program_class

PAGE = 16
SETTINGS = {  # name → (kv_cache_dtype, decode_attention)
    "bf16+flashinfer": ("auto", "flashinfer"),
    "bf16+xqa": ("auto", "xqa"),
    "fp8+flashinfer": ("fp8", "flashinfer"),
    "fp8+xqa": ("fp8", "xqa"),
}


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head="audio")  # fmt: skip
    p.load_lm()
    return p


def test_decode_logits_per_setting_are_reported(program, gpu_report):
    rng = np.random.default_rng(0)
    prompts = [
        program.preprocess(t, {}).reshape(-1) for t in ("Hello there.", "A longer sentence, with commas.")
    ]
    seqs = [
        np.concatenate([p, rng.integers(128266, 128266 + 7 * 4096, size=48)]).astype(np.int64)
        for p in prompts
    ]
    steps = forced_batches(seqs, [len(p) for p in prompts])
    logits = {}
    for name, (kv, decode) in SETTINGS.items():
        cache = allocate_kv_cache(program.num_layers, 64, PAGE, program.num_kv_heads, program.head_dim,
                                  kv_dtype(kv, program.dtype), "cuda")  # fmt: skip
        limits = GpuWorkerSettings(max_batch_size=8, max_context=1200, decode_attention=decode)
        logits[name] = run_forced(make_runner(program, cache, limits), steps)[1:]  # decode steps only
    base = logits["bf16+flashinfer"]
    res = gpu_report("xqa-parity")
    res["decode_logits_vs_bf16_flashinfer"] = {
        n: compare(v, base) for n, v in logits.items() if v is not base
    }
    res["decode_logits_fp8_xqa_vs_fp8_flashinfer"] = compare(logits["fp8+xqa"], logits["fp8+flashinfer"])
    assert all(torch.isfinite(v).all() for v in logits.values())


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_alone_equal_those_among_others(program, gpu_report, setting):
    prompt, engine = greedy_setup(program)
    kv, decode = SETTINGS[setting]
    got = greedy_batches(
        engine,
        prompt,
        {"kv_cache_dtype": kv, "decode_attention": decode, "decode_row_tile": 64},
        others=(3, 17, 40),
    )
    gpu_report("xqa-parity").setdefault("greedy_alone_vs_batched", {})[setting] = got
    assert {k: v["first_difference"] for k, v in got.items()} == dict.fromkeys(got, None)
