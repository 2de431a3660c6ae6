"""Batched prefill graphs: k new requests whose prompts share a row bucket R in one forward pass
(`lm_prefill_k`, one graph per (k, R), 2 <= k <= max_k, R a prefill bucket of at most
`MIXED_PREFILL_ROWS` rows), so a burst of arrivals starts many prompts a step for about the price
of one pass (its weights read once) instead of a pass each.

Each prompt rounds as it does alone, so a request's tokens do not depend on who arrived with it:
- a prompt has a segment of R rows of its own (its rows, then padding), with arena spans and an
  attention wrapper of its own, planned exactly as its prefill graph plans it alone (one request
  and one padding entry in bucket R);
- the GEMMs take every segment's rows at once, which leaves each row's bits as they are only where
  the GEMMs are float8 (bench/op_invariance.py: a row the same at any row count on the H200). A
  bf16 GEMM can round a row otherwise at another row count, so these graphs exist only for float8
  weights (`batched_prefill_enabled`); elsewhere each prompt keeps its own graph (the lanes);
- each prompt's output head runs on its own last row, as in its prefill graph.

`place` assigns a step's prompts: the first to lane 0 (a mixed graph with the decode rows, or lane
0's prefill graph, as before), the others of one bucket R <= MIXED_PREFILL_ROWS, two or more, to the
batched graph (k, R), and the rest (alone in their bucket, or longer) to lanes 1, 2, ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.graphs import capture
from gpu_worker.attention.interface import GraphAttention, GraphAttentionBackend
from gpu_worker.runner.arena import InputArena
from gpu_worker.runner.batch import StepBatch, rows_of
from gpu_worker.runner.prefill_graphs import (
    PrefillLayout,
    empty_prefill,
    fill_prefill,
    pick_bucket,
    prefill_layout,
    prefill_spans,
)
from programs.base import LMProgram

log = logging.getLogger(__name__)

# Prompts one batched graph takes at most, unless `--max-prefills` says otherwise.
MAX_BATCHED = 8


def batched_prefill_enabled(program: LMProgram, limits) -> bool:
    """Whether prompts may share a forward pass: every GEMM of the backbone float8 (row-invariant).
    Read from the program, whose weights the GEMMs use (`program.quantization`), not from the
    settings: a runner built with other settings than the program's loader runs the same weights."""
    return bool(program.mixed_prefill and limits.mixed_prefill and program.quantization == "fp8")


def segment_prefix(rows: int, j: int) -> str:
    """Arena span names of segment j of the batched graphs of bucket `rows`: b32_0_ids, …"""
    return f"b{rows}_{j}_"


def batched_spans(buckets: list[int], max_k: int, n_codebooks: int, max_pages: int) -> dict[str, int]:
    """Arena spans of every segment of every bucket (after the lanes' spans)."""
    spans: dict[str, int] = {}
    for rows in buckets:
        for j in range(max_k):
            spans |= prefill_spans(rows, 1, n_codebooks, max_pages, segment_prefix(rows, j))
    return spans


class Segments:
    """k prefill wrappers as one (`GraphAttention` takes it as its wrapper): segment j is rows
    [j*R, (j+1)*R), attended by wrapper j alone."""

    def __init__(self, wrappers: list, rows: int) -> None:
        self.wrappers, self.rows = wrappers, rows

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        r = self.rows
        return torch.cat([w.run(q[j * r : (j + 1) * r], cache) for j, w in enumerate(self.wrappers)])


@dataclass
class Placement:
    """Where a step's prompts run: request index → lane, and bucket rows → request indices of its
    batched graph (in the order the graphs replay)."""

    lanes: list[int] = field(default_factory=list)  # request index of each lane used, in lane order
    groups: dict[int, list[int]] = field(default_factory=dict)


class BatchedPrefill:
    """The batched prefill graphs and their segments' wrappers; `GraphRunner` owns the arena and
    calls place, fill, plan, replay."""

    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        arena: InputArena,
        attn: GraphAttentionBackend,
        pool,
        buckets: list[int],
        max_k: int,
        max_pages: int,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.program, self.kv_cache, self.arena, self.attn = program, kv_cache, arena, attn
        self.page_size = kv_cache.shape[3]
        self.buckets, self.max_k = sorted(buckets, reverse=True), max_k  # capture (and replay) order
        self.wrappers: dict[int, list] = {}
        empty = empty_prefill(program.n_codebooks)
        for rows in self.buckets:
            lay = prefill_layout(empty, rows, 1, self.page_size)
            self.wrappers[rows] = [
                attn.prepare_capture_prefill(rows, 1, max_pages, lay) for _ in range(max_k)
            ]
        # (k, rows) → (graph, (logits [k, C', V], hidden [k, H]))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        t0 = time.monotonic()
        for rows in self.buckets:
            for k in range(2, max_k + 1):
                if progress:
                    progress(f"capturing batched prefill graphs: {k} prompts of {rows} rows")
                self.graphs[k, rows] = self._capture(k, rows, pool)
        log.info("captured %d batched prefill graphs (prompts 2..%d, rows %s) in %.1f s", len(self.graphs),
                 max_k, self.buckets, time.monotonic() - t0)  # fmt: skip

    @torch.inference_mode()
    def _capture(self, k: int, rows: int, pool) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        p, a, c = self.program, self.arena, self.program.n_codebooks
        xs = [segment_prefix(rows, j) for j in range(k)]

        def cat(name: str, n: int) -> torch.Tensor:
            return torch.cat([a.dev_view(x + name, n) for x in xs])

        attn = GraphAttention(self.kv_cache, Segments(self.wrappers[rows][:k], rows), None, None)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            # the segments' spans as one batch, inside the graph (a concatenation is a copy)
            ids, pos, where = cat("ids", rows * c).view(k * rows, c), cat("pos", rows), cat("where", 2 * rows)
            last = torch.cat([a.dev_view(x + "last", 1) + j * rows for j, x in enumerate(xs)])  # [k]
            attn.page, attn.off = cat("page", rows), cat("off", rows)  # every segment's write slots
            rows_k = rows_of(where.view(-1, 2), prompt_rows=k * rows)  # every row a prompt row
            hidden = p.backbone(p.embed(ids, rows_k), pos, attn)[last]  # [k, H]
            # each prompt's head on its own row, as in its prefill graph ([1, H])
            logits = torch.cat([p.head(hidden[j : j + 1]).float() for j in range(k)])
            return logits, hidden  # [k, C', V], [k, H]

        return capture(step, pool)

    # --- a step --------------------------------------------------------------------------------
    def place(self, rows: list[int], lane_buckets, lanes: int) -> Placement | None:
        """Where prompts of `rows` rows (a step's, in order) run: see the module docstring. None
        when they need more lanes than `lanes` or a prompt fits no prefill graph."""
        out = Placement()
        by_bucket: dict[int, list[int]] = {}
        for i, n in enumerate(rows):
            bucket = pick_bucket(lane_buckets, 1, n)
            if bucket is None:
                return None
            if i == 0 or bucket[0] not in self.wrappers:
                out.lanes.append(i)
            else:
                by_bucket.setdefault(bucket[0], []).append(i)
        for r in self.buckets:
            group = by_bucket.get(r, [])
            if len(group) == 1:
                out.lanes.append(group[0])
            elif len(group) > self.max_k:
                return None
            elif group:
                out.groups[r] = group
        out.lanes.sort()
        return out if len(out.lanes) <= lanes else None

    def layouts(self, pres: list[StepBatch], rows: int) -> list[PrefillLayout]:
        return [prefill_layout(pre, rows, 1, self.page_size) for pre in pres]

    def fill(self, pres: list[StepBatch], lays: list[PrefillLayout], rows: int) -> None:
        for j, (pre, lay) in enumerate(zip(pres, lays, strict=True)):
            fill_prefill(self.arena, pre, lay, segment_prefix(rows, j))

    def plan(self, lays: list[PrefillLayout], rows: int) -> None:
        for j, lay in enumerate(lays):
            kv = self.arena.dev_view(segment_prefix(rows, j) + "kv", len(lay.kv_indices))
            self.attn.prepare_replay_prefill(self.wrappers[rows][j], lay, kv)

    def replay(self, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph, out = self.graphs[k, rows]
        graph.replay()
        return out[0], out[1]  # [k, C', V], [k, H]


def in_request_order(
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A step's prefill outputs, each (request indices, logits [n, C', V], hidden [n, H]), as
    lists of logits and hidden states in request order (lanes run in order; a batched graph takes
    its requests out of it: then one gather each)."""
    ix = [i for part, _, _ in parts for i in part]
    logits, hiddens = [lg for _, lg, _ in parts], [h for _, _, h in parts]
    if ix == sorted(ix):
        return logits, hiddens
    where = torch.tensor(sorted(range(len(ix)), key=ix.__getitem__), device=logits[0].device)
    return [torch.cat(logits)[where]], [torch.cat(hiddens)[where]]
