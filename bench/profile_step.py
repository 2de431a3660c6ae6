"""GPU: where a full engine step's time goes at one batch size (torch.profiler): the busiest
CUDA kernels and CPU ops over a few steady decode steps, and the GPU's idle share; with `--host`,
where the host's time goes (cProfile over the engine's Python: schedule, layout, launch, process;
the wait for the device shows as `ModelRunner.wait`).

    voxpipe bench profile --batch 384 [--ctx 512] [--lm-head audio] [--quantization fp8]
        [--kv-cache-dtype fp8] [--prompt-tokens 40[,T2...] [--prompts-per-step 1,2] [--profile-prompts K]
        [--max-prefills 16]]
    voxpipe bench profile --model qwen3-tts --fused-step on --batch 16 --ctx 100 --host
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_speed import prompt
from bench.lm_options import fill_batch
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.batched_prefill import MAX_BATCHED
from gpu_worker.runner.sampler import use_tail_kernel
from programs import get_spec, load_program_class


def profiled(eng: Engine, steps: int, before=None) -> tuple[float, object]:
    """`steps` engine steps under torch.profiler (`before(i)` ahead of step i) → (wall ms a step,
    the profiler's key averages)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(eng, steps, before)
    return wall, prof.key_averages()


def timed(eng: Engine, steps: int, before=None) -> float:
    """Wall ms a step over `steps` engine steps (`before(i)` ahead of step i), not profiled."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        if before is not None:
            before(i)
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / steps


def report(label: str, wall: float, events, steps: int, rows: int) -> None:
    gpu_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{label}: {wall:.2f} ms/step wall (profiled); kernels {gpu_us / 1000 / steps:.2f} ms/step")
    print(events.table(sort_by="device_time_total", row_limit=rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


SENTENCE = "Sentence number {i}: the quick brown fox jumps over the lazy dog today."


def fill_text(eng: Engine, bs: int, ctx: int) -> float:
    """Start `bs` requests of a sentence each (the model's sampling defaults), step until every one
    is admitted and the batch's mean context reaches `ctx`; → that mean context."""
    for i in range(bs):
        eng.add(prompt(eng.program, f"r{i}", SENTENCE.format(i=i), i, ctx + 200))
    while eng.waiting or any(r.n_ctx == 0 for r in eng.running.values()):
        eng.step()
    while sum(r.n_ctx for r in eng.running.values()) < ctx * bs:
        eng.step()
    assert len(eng.running) == bs, f"batch {bs}: only {len(eng.running)} running"
    return sum(r.n_ctx for r in eng.running.values()) / bs


def host_profile(eng: Engine, steps: int, rows: int, before=None) -> None:
    """cProfile over `steps` engine steps: the host functions by their own time and by their
    cumulative time, and the engine's own averages of a step's host, launch and wait time."""
    prof = cProfile.Profile()
    prof.enable()
    timed(eng, steps, before)
    prof.disable()
    m = eng.metrics()
    print(f"host profile over {steps} steps (the engine's averages, unprofiled steps included: host "
          f"{m['step_host_ms']} ms, launch {m['step_launch_ms']} ms, wait {m['step_wait_ms']} ms, "
          f"device {m['step_gpu_ms']} ms a step)", flush=True)  # fmt: skip
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="orpheus")
    ap.add_argument(
        "--fused-step", default="off", help="on: the program's fused layers and the sampler kernel"
    )
    ap.add_argument("--host", action="store_true", help="also cProfile the host's work over the steps")
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lm-head", default="full")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument(
        "--prompt-tokens",
        default="0",
        help="then steps with new requests of this many prompt tokens in them, and what a prompt adds "
        "to a step (the load's fitted step cost reads 3.2-3.5 ms on the H200); several lengths "
        "(e.g. 21,38, a burst's sentences of two prompt buckets) are taken in turn; 0 = off",
    )
    ap.add_argument("--prompts-per-step", default="1,2", help="new requests in each such step, per run")
    ap.add_argument(
        "--profile-prompts",
        type=int,
        default=0,
        help="the prompts a step of the profiled prompt steps starts (0: the first of --prompts-per-step)",
    )
    ap.add_argument(
        "--max-prefills",
        type=int,
        default=0,
        help=f"as the server's: prompts a batched prefill graph takes (0: its default, {MAX_BATCHED})",
    )
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.prompt_tokens.split(",") if int(n) > 0]
    per_step = [int(k) for k in args.prompts_per_step.split(",")] if lengths else []
    p = load_program_class(args.model)(get_spec(args.model), load_format="dummy", device="cuda",
                                       dtype=torch.bfloat16, lm_head=args.lm_head,
                                       quantization=args.quantization)  # fmt: skip
    p.load_lm()
    if args.fused_step == "on":
        print(f"fused layers {p.fuse_layers()}, sampler kernel {use_tail_kernel(True)}", flush=True)
    extra = max(per_step, default=0)  # the prompts' requests join as old ones leave
    eng = Engine(
        p,
        GpuWorkerSettings(
            max_batch_size=args.batch + extra,
            max_context=args.ctx + args.batch + 300,
            first_chunk="reference",
            kv_cache_dtype=args.kv_cache_dtype,
            max_prefills=args.max_prefills,
        ),
    )
    if args.model == "orpheus":
        mean_ctx = fill_batch(eng, args.batch, args.ctx)
    else:
        mean_ctx = fill_text(eng, args.batch, args.ctx)
    print(f"batch {args.batch} running at mean context {mean_ctx:.0f}", flush=True)
    for _ in range(5):
        eng.step()
    base = timed(eng, 3 * args.steps)
    print(f"batch {args.batch}, decode only: {base:.3f} ms/step (wall, not profiled)", flush=True)
    wall, events = profiled(eng, args.steps)
    report(f"batch {args.batch}", wall, events, args.steps, args.rows)
    if args.host:
        host_profile(eng, 3 * args.steps, args.rows)
    made = itertools.count()
    # Every step starts the k prompts it is given, whatever room the fitted step cost leaves them
    # (the server paces admission by it; here prompts would queue from one timed run to the next).
    eng.scheduler.real_time = False

    def oldest() -> str:
        """The oldest running request that has run a step (an abort takes it out of `running` at
        once): the batch keeps its size, one leaves as one comes, for as many prompt steps as the
        runs take."""
        return next(r for r, req in eng.running.items() if req.n_ctx > 0)

    def new_prompts(k: int):
        def before(_: int) -> None:
            for _ in range(k):
                eng.abort(oldest())
                i = next(made)
                if args.model != "orpheus":
                    eng.add(
                        prompt(eng.program, f"prompt{i}", SENTENCE.format(i=i), 10_000 + i, args.ctx + 200)
                    )
                    continue
                rows = np.full(lengths[i % len(lengths)], 128300, dtype="<i4")
                rows[0] = 128259
                sp = SamplingParams(temperature=0.6, top_p=0.8, seed=10_000 + i, constrained=True)
                eng.add(Prompt(f"prompt{i}", rows.tobytes(), len(rows), sp))

        return before

    for k in per_step:
        with_prompts = timed(eng, 3 * args.steps, new_prompts(k))
        base = timed(eng, 3 * args.steps)  # again, at the context the batch has now
        print(f"{k} prompt(s) of {args.prompt_tokens} tokens in every step: {with_prompts:.3f} ms/step against "
              f"{base:.3f} decode only: {(with_prompts - base) / k:.3f} ms a prompt (wall, not profiled)", flush=True)  # fmt: skip
    if per_step:
        k = args.profile_prompts or per_step[0]
        wall, events = profiled(eng, args.steps, new_prompts(k))
        report(f"batch {args.batch}, {k} {args.prompt_tokens}-token prompt(s) in every step", wall, events,
               args.steps, args.rows)  # fmt: skip
        if args.host:
            host_profile(eng, 3 * args.steps, args.rows, new_prompts(k))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
