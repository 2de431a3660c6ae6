"""GPU: what decoding on XQA (gpu_worker/attention/xqa.py) changes, with dummy Orpheus-3B weights.

1. Teacher-forced logits of the decode steps (graphs on, two prompts, 48 forced tokens each) for
   each (cache dtype, decode attention) against FlashInfer over a bf16 cache, the serving default:
   XQA over bf16 isolates the kernel, FlashInfer over fp8 the cache's rounding, XQA over fp8 both
   plus its fp8 attention math.
2. Greedy tokens of a request alone and among others, per setting (the engine path: page tables
   per slot, gathered per step).

    python -m bench.xqa_parity --out xqa_parity.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from bench.gpu_parity import forced_batches, greedy_batches, greedy_setup, parity_header, run_forced
from bench.prefill_parity import compare
from gpu_worker.engine import EngineLimits
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="xqa_parity.json")
    args = ap.parse_args()
    res = parity_header()
    program = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                            dtype=torch.bfloat16, lm_head="audio")  # fmt: skip
    program.load_lm()
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
        limits = EngineLimits(max_batch_size=8, max_context=1200, decode_attention=decode)
        logits[name] = run_forced(make_runner(program, cache, limits), steps)[1:]  # decode steps only
    base = logits["bf16+flashinfer"]
    res["decode_logits_vs_bf16_flashinfer"] = {
        n: compare(v, base) for n, v in logits.items() if v is not base
    }
    res["decode_logits_fp8_xqa_vs_fp8_flashinfer"] = compare(logits["fp8+xqa"], logits["fp8+flashinfer"])
    print(json.dumps(res, indent=1), flush=True)

    prompt, engine = greedy_setup(program)
    res["greedy_alone_vs_batched"] = {}
    for name, (kv, decode) in SETTINGS.items():
        got = greedy_batches(engine, prompt, {"kv_cache_dtype": kv, "decode_attention": decode})
        res["greedy_alone_vs_batched"][name] = got
        print(name, json.dumps(got), flush=True)
    res["ok"] = all(
        v["first_difference"] is None for per in res["greedy_alone_vs_batched"].values() for v in per.values()
    )
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"ok": res["ok"]}), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
