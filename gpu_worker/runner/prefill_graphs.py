"""CUDA graphs for the prefill part of a step (`lm_prefill`): one captured graph per row bucket.

A bucket is (rows, reqs): the graph runs `rows` prompt rows as `reqs + 1` attention requests,
because a CUDA-graph prefill wrapper fixes its batch size (the length of its qo/kv indptr buffers)
and, at its first plan, its total row count (a later plan with more rows fails; the work schedule,
sized for that total, keeps the same shape, so the captured kernels stay valid). The step's n new
requests come first; entries n..reqs-1 are one padding row each and the last entry takes the rest
of the rows (at least one), so every entry has rows and the row total is always `rows`.
Padding rows are arena zeros: token 0 at position 0, key/value written to the reserved page 0,
attending causally to a context made of page 0 alone. Harmless work; their logits are not computed
(the head runs on each request's last row only, as in the eager runner).

A guided program's request (programs.base: Classifier-free guidance) brings S = 2 KV sequences: its
prompt takes a bucket of reqs = S, one attention request per sequence, and the graph pairs the
sequences' last rows into the request's logits (`gpu_worker.runner.batch.paired`).

Keys/values are written into their pages first, then the backend's prefill wrapper attends causally
(bottom-right aligned, like the eager path, which runs the same kernel un-captured). Small buckets
serve a single short prompt (20-60 rows) without padding it to hundreds of rows; steps that fit no
bucket (more new requests or rows than the largest) run their prefill eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.graphs import capture
from gpu_worker.attention.interface import GraphAttention, GraphAttentionBackend, page_arrays
from gpu_worker.runner.arena import InputArena
from gpu_worker.runner.batch import StepBatch, kv_sequences, paired, rows_of
from gpu_worker.runner.kv_cache import pages_for
from programs.base import LMProgram

log = logging.getLogger(__name__)

# New requests one prefill graph takes. One: a request's prefill then depends on its own prompt only
# (its bucket, GEMM row count and attention batch), so its tokens do not depend on which requests
# arrived with it. On the H200, prefilled together with another request in a (64, 4) graph, a
# greedy request's tokens differ from its tokens alone from token 12 on (bf16 rounding). Several
# new requests in one step each take a graph of their own, from a *lane* of graphs with its own
# arena spans and attention wrappers (`gpu_worker.runner.graphs.PREFILL_LANES`).
MAX_PREFILL_REQS = 1
MIN_PREFILL_ROWS = 32
REQS_PER_ROWS = 16  # a bucket of R rows takes up to R // 16 requests, so small buckets stay small
# Below this many rows the buckets grow by half a power of two (32, 48, 64, 96, 128), not double:
# the prompts a burst brings are short (a TTS model's sentence is a few dozen tokens), each pads to
# its bucket, and a step of ~20 of them in 64-row segments spends a third of its prompt rows on
# padding where a 38-token prompt would take 48 rows.
HALF_STEPS_BELOW = 128


def prefill_buckets(max_context: int, max_reqs: int = MAX_PREFILL_REQS) -> list[tuple[int, int]]:
    """(rows, reqs) per graph: rows 32, 48, 64, 96, 128, then doubling to 1024, then steps of 512,
    until one prompt of `max_context` rows fits with its padding."""
    top = max_context + max_reqs + 1
    out, rows = [], MIN_PREFILL_ROWS
    while True:
        out.append((rows, max(1, min(max_reqs, rows // REQS_PER_ROWS))))
        if rows >= top:
            return out
        if rows < HALF_STEPS_BELOW:
            rows = rows * 3 // 2 if rows & (rows - 1) == 0 else rows * 4 // 3
        else:
            rows = rows * 2 if rows < 1024 else rows + 512


def pick_bucket(buckets: list[tuple[int, int]], n_reqs: int, n_rows: int) -> tuple[int, int] | None:
    """The smallest bucket that holds n_reqs requests of n_rows rows in all, plus one padding row
    for each unused request entry and at least one for the last entry; None: run eagerly."""
    for rows, reqs in buckets:
        if n_reqs <= reqs and n_rows + (reqs - n_reqs) + 1 <= rows:
            return rows, reqs
    return None


def max_prefill_pages(rows: int, reqs: int, max_context: int, page_size: int) -> int:
    """Bound on one prefill plan's page indices: reqs whole contexts, one page per one-row pad,
    and the last entry's pages."""
    return reqs * pages_for(max_context + 1, page_size) + reqs + pages_for(rows, page_size)


@dataclass
class PrefillLayout:
    rows: int
    reqs: int
    qo_indptr: np.ndarray  # [reqs + 2] int32 row offsets: n requests, then the padding entries
    kv_indptr: np.ndarray  # [reqs + 2] int32
    kv_indices: np.ndarray  # [pages] int32
    kv_last: np.ndarray  # [reqs + 1] int32
    page: np.ndarray  # [r] int64 page each real row's key/value goes to
    off: np.ndarray  # [r] int64 offset in that page
    last: np.ndarray  # [n] int64 each request's last row


def prefill_layout(pre: StepBatch, rows: int, reqs: int, page_size: int) -> PrefillLayout:
    """Page tables and write slots of the prefill requests `pre`, padded to the bucket (rows, reqs)."""
    n, r = pre.batch_size, pre.qo_indptr[-1]
    pad = [1] * (reqs - n) + [rows - r - (reqs - n)]
    if n > reqs or pad[-1] < 1:
        raise ValueError(f"{n} requests of {r} rows do not fit the prefill bucket ({rows}, {reqs})")
    qo = np.asarray([*pre.qo_indptr, *(r + np.cumsum(pad))], dtype=np.int32)
    # A padding entry's context is its own rows (causal, so every row sees a key), all on page 0.
    tables = [*pre.page_tables, *([0] * pages_for(p, page_size) for p in pad)]
    kv_indptr, kv_indices, kv_last = page_arrays([*pre.kv_lens, *pad], tables, page_size)
    pos = np.asarray(pre.pos, dtype=np.int64)
    page = np.empty(r, dtype=np.int64)
    for b in range(n):
        lo, hi = qo[b], qo[b + 1]
        page[lo:hi] = np.asarray(tables[b], dtype=np.int64)[pos[lo:hi] // page_size]
    last = np.asarray(pre.qo_indptr[1:], dtype=np.int64) - 1
    return PrefillLayout(rows, reqs, qo, kv_indptr, kv_indices, kv_last, page, pos % page_size, last)


def lane_prefix(lane: int | str) -> str:
    """Arena span names of a lane of prefill graphs: p_ids, … for lane 0; p1_ids, … for lane 1 (a
    string: that prefix, a batched graph's segment: gpu_worker.runner.batched_prefill)."""
    if isinstance(lane, str):
        return lane
    return "p_" if lane == 0 else f"p{lane}_"


def prefill_spans(
    rows: int, reqs: int, n_codebooks: int, max_pages: int, lane: int | str = 0
) -> dict[str, int]:
    """Arena spans one lane of prefill graphs reads (after the decode spans)."""
    p = lane_prefix(lane)
    return {
        p + "last": reqs,
        p + "ids": rows * n_codebooks,
        p + "pos": rows,
        p + "where": 2 * rows,
        p + "page": rows,
        p + "off": rows,
        p + "kv": max_pages,  # page indices: planned from the device, so `plan` never blocks
    }


def fill_prefill(arena: InputArena, pre: StepBatch, lay: PrefillLayout, lane: int | str = 0) -> None:
    """Write the real rows into the (zeroed) host arena; padding rows stay zero."""
    r, p = pre.qo_indptr[-1], lane_prefix(lane)
    arena.host_view(p + "ids", pre.ids.size).copy_(
        torch.from_numpy(np.ascontiguousarray(pre.ids).reshape(-1))
    )
    arena.host_view(p + "pos", r).copy_(torch.from_numpy(np.asarray(pre.pos, dtype=np.int64)))
    arena.host_view(p + "where", 2 * r).copy_(torch.from_numpy(pre.row_where().reshape(-1)))
    arena.host_view(p + "page", r).copy_(torch.from_numpy(lay.page))
    arena.host_view(p + "off", r).copy_(torch.from_numpy(lay.off))
    arena.host_view(p + "last", len(lay.last)).copy_(torch.from_numpy(lay.last))
    arena.host_view(p + "kv", len(lay.kv_indices)).copy_(torch.from_numpy(lay.kv_indices))


def empty_prefill(n_codebooks: int) -> StepBatch:
    return StepBatch(np.zeros((0, n_codebooks), np.int64), np.zeros(0, np.int64), [0], [], [], 0)


class PrefillGraphs:
    """The captured prefill graphs of one lane; `GraphRunner` owns the arena and calls fill, plan,
    replay. Their attention comes from the graphs' backend (`attn`)."""

    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        arena: InputArena,
        attn: GraphAttentionBackend,
        pool,
        buckets: list[tuple[int, int]],
        max_pages: int,
        progress: Callable[[str], None] | None = None,
        lane: int | str = 0,
        stream=None,
    ) -> None:
        """`stream`: the one to capture on (`common.graphs.capture`), where not torch's."""
        self.program, self.kv_cache, self.arena, self.attn, self.lane = program, kv_cache, arena, attn, lane
        self.stream = stream
        self.prefix = lane_prefix(lane)
        self.sequences = kv_sequences(program)  # KV sequences a request (attention requests a prompt)
        self.page_size = kv_cache.shape[3]
        self.buckets = buckets
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        t0 = time.monotonic()
        for i, (rows, reqs) in enumerate(sorted(buckets, reverse=True)):
            if progress:
                progress(f"capturing prefill graphs, lane {lane}: {rows} rows ({i + 1}/{len(buckets)})")
            self.graphs[rows] = self._capture(rows, reqs, pool, max_pages)
        log.info("captured %d prefill graphs (rows, requests) %s for lane %s in %.1f s", len(buckets), buckets,
                 lane, time.monotonic() - t0)  # fmt: skip

    @torch.inference_mode()
    def _capture(self, rows: int, reqs: int, pool, max_pages: int):
        p, a, c = self.program, self.arena, self.program.n_codebooks
        lay = prefill_layout(empty_prefill(c), rows, reqs, self.page_size)
        wrapper = self.attn.prepare_capture_prefill(rows, reqs, max_pages, lay)
        x = self.prefix
        ids, pos, last = (
            a.dev_view(x + "ids", rows * c).view(rows, c),
            a.dev_view(x + "pos", rows),
            a.dev_view(x + "last", reqs),
        )
        w = a.dev_view(x + "where", 2 * rows).view(rows, 2)
        where = rows_of(w, prompt_rows=rows)
        attn = GraphAttention(
            self.kv_cache, wrapper, a.dev_view(x + "page", rows), a.dev_view(x + "off", rows)
        )

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = p.backbone(p.embed(ids, where), pos, attn)[last]  # [reqs, H] each entry's last row
            # [reqs / S, C', V], [reqs / S, H]: a guided request's sequences paired
            return paired(p, p.head(hidden).float(), hidden, w[last, 0], self.sequences)

        graph, out = capture(step, pool, self.stream)
        return graph, wrapper, out

    def layout(self, pre: StepBatch) -> PrefillLayout | None:
        """The padded layout of these prefill requests, or None when no graph holds them."""
        bucket = pick_bucket(self.buckets, pre.batch_size, pre.qo_indptr[-1])
        return None if bucket is None else prefill_layout(pre, *bucket, self.page_size)

    def plan(self, lay: PrefillLayout) -> None:
        """After the arena's copy: the page indices come from the device arena (an on-device copy,
        where a host tensor would make the backend's copy wait for the whole stream)."""
        kv_indices = self.arena.dev_view(self.prefix + "kv", len(lay.kv_indices))
        self.attn.prepare_replay_prefill(self.graphs[lay.rows][1], lay, kv_indices)

    def replay(self, lay: PrefillLayout) -> tuple[torch.Tensor, torch.Tensor]:
        graph, _, out = self.graphs[lay.rows]
        graph.replay()
        n = len(lay.last) // self.sequences  # requests
        return out[0][:n], out[1][:n]  # [n, C', V], [n, H]
