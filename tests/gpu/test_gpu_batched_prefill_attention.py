"""The batched prefill graphs' attention on the GPU (gpu_worker/runner/batched_prefill.py): where
FlashInfer plans k prompt segments as one wrapper (`segments_plan_as_one`: its FA2 kernel over a
float8 cache), every segment's rows get the same bits as from a wrapper of its own, planned as the
segment's prefill graph plans it alone. Orpheus-3B's
attention shape (24 query heads over 8 KV heads of 128), random queries and a random float8 cache,
prompts of random lengths on scattered pages, each bucket of the batched graphs, 2 to 16 segments.
Records each bucket's time of a layer's attention for 16 segments, both ways (a call a segment
against one call)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu_worker.attention.flashinfer import FlashInferGraphs
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.batched_prefill import joined_layout
from gpu_worker.runner.kv_cache import pages_for
from gpu_worker.runner.prefill_graphs import empty_prefill, max_prefill_pages, prefill_layout

PAGE, HQ, HKV, D, PAGES = 16, 24, 8, 128, 4096


def segment(rng: np.random.Generator, rows: int) -> StepBatch:
    """One prompt of 1..rows-1 rows (its padding entry takes the rest) on pages of its own."""
    n = int(rng.integers(1, rows))
    table = rng.choice(np.arange(1, PAGES), size=pages_for(n, PAGE), replace=False).tolist()
    return StepBatch(np.zeros((n, 1), np.int64), np.arange(n), [0, n], [n], [table], 1)


def settled(stage: str) -> None:
    """Wait for the device's work so far: a fault of a kernel queued before (an illegal address
    is reported at the next call that waits, and every call after) names the stage it came in."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise AssertionError(f"the device failed by the end of: {stage}") from e


def differs(k: int, j: int, n: int, got: torch.Tensor, want: torch.Tensor) -> str:
    """Where segment j's rows differ: which of its n prompt rows and of its padding entry's rows,
    by how much at most, in how many heads."""
    bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
    diff = (got.float() - want.float()).abs()
    heads = int((got != want).any(2).any(0).sum())
    return (
        f"k={k}, segment {j}: prompt rows {[r for r in bad if r < n]} of {n} and padding rows "
        f"{[r for r in bad if r >= n]} differ, by up to {diff.max().item():.3g} "
        f"(prompt rows: {diff[:n].max().item():.3g}), in {heads} of {got.shape[1]} heads"
    )


def timed(fn, reps: int = 50) -> float:
    """Mean ms of `fn` on the device."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("rows", [32, 48, 64, 96, 128])
def test_segments_planned_as_one_attend_as_each_alone(gpu_report, rows):
    program = SimpleNamespace(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, device=torch.device("cuda"),
                              dtype=torch.bfloat16)  # fmt: skip
    cache = torch.randn(PAGES, 2, PAGE, HKV, D, device="cuda").to(torch.float8_e4m3fn)
    attn = FlashInferGraphs(program, cache[None], max_batch=1, max_pages=PAGES, tensor_cores=True,
                            no_split_kv=True)  # fmt: skip
    assert attn.segments_plan_as_one(rows)
    rng = np.random.default_rng(rows)
    max_pages = max_prefill_pages(rows, 1, rows, PAGE)
    alone = prefill_layout(empty_prefill(1), rows, 1, PAGE)
    report = gpu_report("batched_prefill_attention")
    for k in (2, 3, 8, 16):
        lays = [prefill_layout(segment(rng, rows), rows, 1, PAGE) for _ in range(k)]
        own = [attn.prepare_capture_prefill(rows, 1, max_pages, alone) for _ in range(k)]
        for w, lay in zip(own, lays, strict=True):
            attn.prepare_replay_prefill(w, lay, torch.from_numpy(lay.kv_indices).cuda())
        settled(f"k={k}: {k} wrappers of a segment each, planned")
        one = attn.prepare_capture_prefill(k * rows, 2 * k - 1, k * max_pages, joined_layout([alone] * k))
        joined = joined_layout(lays)
        attn.prepare_replay_prefill(one, joined, torch.from_numpy(joined.kv_indices).cuda())
        settled(f"k={k}: one wrapper of the {k} segments, planned")
        q = torch.randn(k * rows, HQ, D, device="cuda", dtype=torch.bfloat16)

        def each(q=q, own=own) -> torch.Tensor:
            return torch.cat([w.run(q[j * rows : (j + 1) * rows], cache) for j, w in enumerate(own)])

        want = each()
        settled(f"k={k}: the segments' own wrappers, run")
        got = one.run(q, cache)
        settled(f"k={k}: the one wrapper, run")
        assert torch.isfinite(want).all()
        for j, lay in enumerate(lays):  # every row of every segment, its padding entry's too
            seg = slice(j * rows, (j + 1) * rows)
            if not torch.equal(got[seg], want[seg]):
                # which side is off: a fresh wrapper of the segment alone, planned and run at once
                fresh = attn.prepare_capture_prefill(rows, 1, max_pages, alone)
                attn.prepare_replay_prefill(fresh, lay, torch.from_numpy(lay.kv_indices).cuda())
                ref = fresh.run(q[seg], cache)
                sides = f"; a fresh wrapper equals the own one: {torch.equal(ref, want[seg])}, the joined one: {torch.equal(ref, got[seg])}"
                raise AssertionError(differs(k, j, int(lay.qo_indptr[1]), got[seg], want[seg]) + sides)
        if k == 16:
            report[f"rows_{rows}_k16_ms"] = {
                "a_wrapper_a_segment": timed(each),
                "one_wrapper": timed(lambda one=one, q=q: one.run(q, cache)),
            }
