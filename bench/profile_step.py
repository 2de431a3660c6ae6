"""GPU: where a full engine step's time goes at one batch size (torch.profiler): the busiest
CUDA kernels and CPU ops over a few steady decode steps, and the GPU's idle share.

    python bench/profile_step.py --batch 384 [--ctx 512] [--lm-head audio] [--quantization fp8]
        [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.lm_options import fill_batch
from gpu_worker.engine import Engine, EngineLimits
from programs import get_spec, load_program_class


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lm-head", default="full")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head=args.lm_head,
                                      quantization=args.quantization)  # fmt: skip
    p.load_lm()
    eng = Engine(
        p,
        EngineLimits(
            max_batch_size=args.batch,
            max_context=args.ctx + args.batch + 300,
            first_chunk="reference",
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    )
    mean_ctx = fill_batch(eng, args.batch, args.ctx)
    print(f"batch {args.batch} running at mean context {mean_ctx:.0f}", flush=True)
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000 / args.steps
    events = prof.key_averages()
    gpu_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(
        f"batch {args.batch}: {wall:.2f} ms/step wall (profiled); kernels {gpu_us / 1000 / args.steps:.2f} ms/step"
    )
    print(events.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
