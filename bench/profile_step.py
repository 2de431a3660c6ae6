"""GPU: where a full engine step's time goes at one batch size (torch.profiler): the busiest
CUDA kernels and CPU ops over a few steady decode steps, and the GPU's idle share.

    python bench/profile_step.py --batch 384 [--ctx 512] [--lm-head audio] [--quantization fp8]
        [--kv-cache-dtype fp8] [--prompt-tokens 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.lm_options import fill_batch
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine, EngineLimits
from programs import get_spec, load_program_class


def profiled(eng: Engine, steps: int, before=None) -> tuple[float, object]:
    """`steps` engine steps under torch.profiler (`before(i)` ahead of step i) → (wall ms a step,
    the profiler's key averages)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            if before is not None:
                before(i)
            eng.step()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / steps, prof.key_averages()


def report(label: str, wall: float, events, steps: int, rows: int) -> None:
    gpu_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{label}: {wall:.2f} ms/step wall (profiled); kernels {gpu_us / 1000 / steps:.2f} ms/step")
    print(events.table(sort_by="device_time_total", row_limit=rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lm-head", default="full")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="then the same steps with a new request of this many prompt tokens in each, and what a "
        "prompt adds to a step (the load's fitted step cost reads 3.2-3.5 ms on the H200); 0 = off",
    )
    args = ap.parse_args()
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head=args.lm_head,
                                      quantization=args.quantization)  # fmt: skip
    p.load_lm()
    extra = args.steps if args.prompt_tokens else 0  # the prompts' requests join the batch
    eng = Engine(
        p,
        EngineLimits(
            max_batch_size=args.batch + extra,
            max_context=args.ctx + args.batch + 300,
            first_chunk="reference",
            kv_cache_dtype=args.kv_cache_dtype,
        ),
    )
    mean_ctx = fill_batch(eng, args.batch, args.ctx)
    print(f"batch {args.batch} running at mean context {mean_ctx:.0f}", flush=True)
    for _ in range(5):
        eng.step()
    wall, events = profiled(eng, args.steps)
    report(f"batch {args.batch}", wall, events, args.steps, args.rows)
    if args.prompt_tokens:

        def add_prompt(i: int) -> None:
            rows = np.full(args.prompt_tokens, 128300, dtype="<i4")
            rows[0] = 128259
            sp = SamplingParams(temperature=0.6, top_p=0.8, seed=10_000 + i, constrained=True)
            eng.add(Prompt(f"prompt{i}", rows.tobytes(), len(rows), sp))

        with_prompts, events = profiled(eng, args.steps, add_prompt)
        report(f"batch {args.batch}, a {args.prompt_tokens}-token prompt in every step", with_prompts,
               events, args.steps, args.rows)  # fmt: skip
        print(f"a prompt adds {with_prompts - wall:.2f} ms to a step of {args.batch} (wall, profiled)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
