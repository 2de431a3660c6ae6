"""What the parts of a step cost, measured once at startup for `gpu_worker.scheduler.step_cost.StepCost`.

The steps served tell a step's fixed part from its parts per token, per token of context and per
prompt only where they vary apart, and a ramp's do not: its rows and its streams' contexts grow
together, and a step's time is not linear in its rows. So before serving, the engine times steps
that differ in one thing (GPU only, through the runner's graphs, sampling left out):

- the largest decode bucket and one near half of it, each at a short and a long context: two
  differences in context at equal rows, two in rows at equal contexts;
- the smaller batch at a middle context with and without a prompt riding along (a mixed step);
- that step with one more prompt, and with as many more as the runner's graphs take together
  beside the first (`prompt_groups`: one joining the first in its mixed graph, the rest in a
  batched prefill graph, where the GEMMs are float8; a lane each elsewhere), so the fit tells a
  prompt's own cost from its group's.

Each difference goes to `StepCost.calibrate` as (more tokens, more thousands of tokens of context,
more prompts, more groups of prompts) and the seconds they added. The steps read and write KV pages of a cache that holds
no request yet; what they write is overwritten by the requests that later own those pages.
"""

from __future__ import annotations

import logging
import statistics
import time
from itertools import accumulate

import numpy as np
import torch

from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.kv_cache import pages_for

log = logging.getLogger(__name__)

SHORT, LONG, PROMPT = 128, 1024, 48  # contexts of the decode rows, and a prompt's tokens
WARMUP, TIMED = 2, 6  # steps run at each point before timing, and timed (the median counts)
MORE_PROMPTS = 16  # prompts beside the first that the startup steps try at most


def _batch(n: int, ctx: int, prompts: list[int], c: int, pages: int, page_size: int) -> StepBatch:
    """`n` decode rows at context `ctx` after prompts of `prompts` rows each, every row and prompt
    on pages of its own (wrapping around a cache too small to give each its own)."""
    per = pages_for(ctx, page_size)
    decode = [[1 + (i * per + j) % (pages - 1) for j in range(per)] for i in range(n)]
    starts = accumulate((pages_for(p, page_size) for p in prompts), initial=n * per)  # after the rows'
    tables = [
        [1 + (start + j) % (pages - 1) for j in range(pages_for(p, page_size))]
        for p, start in zip(prompts, starts, strict=False)
    ] + decode
    rows = [*prompts, *[1] * n]
    return StepBatch(
        ids=np.zeros((sum(rows), c), dtype=np.int64),
        pos=np.concatenate([*(np.arange(p) for p in prompts), [ctx - 1] * n]).astype(np.int64),
        qo_indptr=np.concatenate([[0], np.cumsum(rows)]).tolist(),
        kv_lens=[*prompts, *[ctx] * n],
        page_tables=tables,
        num_prefill=len(prompts),
    )


def _seconds(runner, b: StepBatch) -> float:
    """The device time of one forward pass of `b`, the median of TIMED after WARMUP."""
    spans = []
    for i in range(WARMUP + TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(b)
        end.record()
        if i >= WARMUP:
            spans.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in spans) / 1000


def step_differences(
    runner,
    num_pages: int,
    page_size: int,
    max_context: int,
    n_codebooks: int,
    progress=None,
    timer=_seconds,
    steps: dict[tuple[int, int], float] | None = None,
) -> list[tuple[tuple[float, ...], float]]:
    """Time the startup steps on `runner` (a GraphRunner; `timer(runner, batch)` → seconds) →
    `StepCost.calibrate`'s differences; `steps`, when given, gets the largest batches' times at the
    long context ((rows, context of each) → seconds: `StepClock.seed`)."""
    if progress:
        progress("measuring what a step's parts cost")
    t0 = time.monotonic()
    sizes = runner.sizes
    big = sizes[-1]
    small = min(sizes, key=lambda s: abs(s - big / 2))
    prompt = min(PROMPT, max_context // 2)
    # every row of the largest batch on pages of its own at the long context (shared pages would
    # read from the GPU's caches and understate what context costs)
    own = (num_pages - 1 - pages_for(prompt, page_size)) // big * page_size
    short, long = min(SHORT, max_context // 4), min(LONG, max_context - 1, own)

    def t(n: int, ctx: int, prompts: tuple[int, ...] = ()) -> float:
        return timer(runner, _batch(n, ctx, list(prompts), n_codebooks, num_pages, page_size))

    diffs = []
    at = {(n, ctx): t(n, ctx) for n in {big, small} for ctx in {short, long}}
    if long > short:
        for n in {big, small}:
            diffs.append(((0.0, n * (long - short) / 1000, 0.0, 0.0), at[n, long] - at[n, short]))
    if big > small:
        for ctx in {short, long}:
            # each row's context before the step, as the engine counts it: ctx - 1
            diffs.append(
                ((big - small, (big - small) * (ctx - 1) / 1000, 0.0, 0.0), at[big, ctx] - at[small, ctx])
            )
    if steps is not None:
        steps.update({(n, long): at[n, long] for n in {big, small}})
    mid = (short + long) // 2
    if prompt > 0:
        one = t(small, mid, (prompt,))
        diffs.append(((float(prompt), 0.0, 1.0, 1.0), one - t(small, mid)))
        groups = getattr(runner, "prompt_groups", None)
        # more prompts beside the first: one, and the most the graphs take together
        takes = {k: g for k in range(1, MORE_PROMPTS + 1) if groups and (g := groups([prompt] * (1 + k)))}
        for k in sorted({min(takes), max(takes)}) if takes else []:
            diffs.append(
                (
                    (float(k * prompt), 0.0, float(k), float(takes[k] - 1)),
                    t(small, mid, (prompt,) * (1 + k)) - one,
                )
            )
    log.info(
        "step costs at startup (%.1f s): %s; differences (tokens, thousand tokens of context, prompts, "
        "groups: ms) %s",
        time.monotonic() - t0,
        ", ".join(f"{n} rows at {ctx}: {1000 * s:.2f} ms" for (n, ctx), s in sorted(at.items())),
        ", ".join(f"({', '.join(f'{v:g}' for v in dx)}: {1000 * dy:.2f})" for dx, dy in diffs),
    )
    return diffs
