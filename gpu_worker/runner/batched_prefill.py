"""Batched prefill graphs: k new requests whose prompts share a row bucket R in one forward pass
(`lm_prefill_k`, one graph per (k, R), 2 <= k <= max_k, R a prefill bucket of at most
`MIXED_PREFILL_ROWS` rows), so a burst of arrivals starts many prompts a step for about the price
of one pass (its weights read once) instead of a pass each.

Each prompt rounds as it does alone, so a request's tokens do not depend on who arrived with it:
- a prompt has a segment of R rows of its own (its rows, then padding), with arena spans of its own,
  attended as its prefill graph attends it alone (one request and one padding entry in bucket R):
  by one wrapper over all the graph's segments, where the backend plans them as one with each
  segment's bits (`segments_plan_as_one`: FlashInfer's FA2 kernel over a float8 cache, whose query
  tile is then the one a segment alone gets), else by a wrapper a segment planned as alone. One
  kernel a layer instead of one a segment: on an H100, a 3B model's 16 prompts of the 32-row
  bucket beside 288 streams take the step's kernels from 17.3 to 12.7 ms (the per-segment calls
  were 448 a step, 5.1 ms; docs/performance.md, "Batched prefill graphs");
- the GEMMs take every segment's rows at once, which leaves each row's bits as they are only where
  the GEMMs are float8 (bench/op_invariance.py: a row the same at any row count on the H200). A
  bf16 GEMM can round a row otherwise at another row count, so these graphs exist only for float8
  weights and for plain ones in the row-invariant kernel (`batched_prefill_enabled`,
  `--invariant-gemm on`); elsewhere each prompt keeps its own graph (the lanes);
- each prompt's output head runs on its own last row, as in its prefill graph.

The same segments let prompts join the first one in the step's mixed graph (gpu_worker.runner.graphs:
its decode rows, lane 0's prompt, and up to `MIXED_JOINERS` more of lane 0's bucket, each in a
segment of its own), so a prompt that arrives while streams run costs its rows and not a pass of
its own: on the H200 (a 3B backbone, fp8, a step of 256 rows) a 48-token prompt riding the decode pass
adds 1.5 ms, two more joining it 1.9 ms, and two more in a batched graph instead 3.9 ms.

`place` assigns a step's prompts: the first to lane 0 (a mixed graph with the decode rows, or lane
0's prefill graph), up to `join` more of its bucket with it (the mixed graph's joiners, where the
step decodes), the others of one bucket R <= MIXED_PREFILL_ROWS, two or more, to the batched graph
(k, R), and the rest (alone in their bucket, or longer) to lanes 1, 2, ...
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from common.graphs import capture
from common.pinned import to_device
from gpu_worker.attention.interface import GraphAttention, GraphAttentionBackend
from gpu_worker.runner.arena import InputArena
from gpu_worker.runner.batch import StepBatch, rows_of
from gpu_worker.runner.kv_cache import pages_for
from gpu_worker.runner.prefill_graphs import (
    PrefillLayout,
    empty_prefill,
    fill_prefill,
    pick_bucket,
    prefill_layout,
    prefill_spans,
)
from programs.base import LMProgram
from programs.blocks import fp8

log = logging.getLogger(__name__)

# Prompts one batched graph takes at most, unless `--max-prefills` says otherwise: a burst on a
# fresh worker starts that many beside a step's first and its joiner, where lead borrow gives the
# step room for them (docs/operations.md, "Prompts per step").
MAX_BATCHED = 16


def batched_prefill_enabled(program: LMProgram, limits) -> bool:
    """Whether prompts may share a forward pass: every GEMM of the backbone row-invariant, float8
    or in the row-invariant kernel (`--invariant-gemm on`). Read from what runs the GEMMs (the
    program's weights, `program.quantization`, and the process's kernel, `fp8.invariant_gemm_on`),
    not from the settings: a runner built with other settings than the program's loader runs the
    same weights."""
    invariant = program.quantization == "fp8" or fp8.invariant_gemm_on()
    return bool(program.mixed_prefill and limits.mixed_prefill and invariant)


# Prompts that may join the first one in a mixed graph (gpu_worker.runner.graphs): a mixed graph per
# decode bucket, bucket of at most MIXED_PREFILL_ROWS rows and number of joiners. One: under Poisson
# arrivals a step's prompts are mostly one or two (a 3B TTS model at 80 req/s: 0.47 a step), and each
# joiner count captures another set of mixed graphs (on the H200 with three, 324 graphs in 22 s at
# startup instead of 81 in 4 s); a step's third prompt takes a batched graph or a lane.
MIXED_JOINERS = 1


def segment_prefix(rows: int, j: int, kind: str = "b") -> str:
    """Arena span names of segment j of bucket `rows`: b32_0_ids, … for the batched graphs, m32_0_ids,
    … for a mixed graph's joiners."""
    return f"{kind}{rows}_{j}_"


def batched_spans(
    buckets: list[int], max_k: int, n_codebooks: int, max_pages: int, kind: str = "b"
) -> dict[str, int]:
    """Arena spans of every segment of every bucket (after the lanes' spans)."""
    spans: dict[str, int] = {}
    for rows in buckets:
        for j in range(max_k):
            spans |= prefill_spans(rows, 1, n_codebooks, max_pages, segment_prefix(rows, j, kind))
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
    """Where a step's prompts run: request index → lane, the requests joining lane 0's in its mixed
    graph, and bucket rows → request indices of its batched graph (in the order the graphs replay)."""

    lanes: list[int] = field(default_factory=list)  # request index of each lane used, in lane order
    groups: dict[int, list[int]] = field(default_factory=dict)
    joiners: list[int] = field(default_factory=list)


def joined_layout(lays: list[PrefillLayout]) -> PrefillLayout:
    """k segments' layouts (each a request and its padding entry in a bucket of R rows) as one
    plan of 2k entries over k x R rows: segment j's rows, pages and page table entries follow
    segment j - 1's. For planning only: its write slots (`page`, `off`) are the segments' real rows
    one after the other, not at their rows in the k x R (each segment fills its own spans)."""
    rows, pages = lays[0].rows, np.cumsum([0] + [int(lay.kv_indptr[-1]) for lay in lays])
    cat = np.concatenate
    return PrefillLayout(
        rows * len(lays), 2 * len(lays) - 1,
        cat([*(lay.qo_indptr[:-1] + j * rows for j, lay in enumerate(lays)), [rows * len(lays)]]).astype(np.int32),
        cat([*(lay.kv_indptr[:-1] + pages[j] for j, lay in enumerate(lays)), pages[-1:]]).astype(np.int32),
        cat([lay.kv_indices for lay in lays]).astype(np.int32), cat([lay.kv_last for lay in lays]).astype(np.int32),
        cat([lay.page for lay in lays]), cat([lay.off for lay in lays]),
        cat([lay.last + j * rows for j, lay in enumerate(lays)]),
    )  # fmt: skip


def joined_keeps_bits(
    program: LMProgram, kv_cache: torch.Tensor, attn: GraphAttentionBackend, rows: int, k: int, joined, single
) -> bool:
    """The startup check of `segments_plan_as_one` (a rule read off the attention library): k
    segments of `rows` rows, prompts of random lengths on random pages of a scratch cache of random
    values (the cache's dtype), attended by `joined` (a wrapper planned over all k) and, one after
    the other, by `single` (a segment's own wrapper): the same bits in every row? False, and the
    batched graphs keep a wrapper a segment, where they differ or the check fails."""
    try:
        page = kv_cache.shape[3]
        rng = np.random.default_rng(rows * 1000 + k)
        pages = 1 + k * pages_for(rows, page)
        cache = torch.randn(pages, 2, page, *kv_cache.shape[4:], device=kv_cache.device).to(kv_cache.dtype)
        order = rng.permutation(np.arange(1, pages))
        lays, used = [], 0
        for _ in range(k):
            n = int(rng.integers(1, rows))
            table = order[used : used + pages_for(n, page)].tolist()
            used += len(table)
            pre = StepBatch(
                np.zeros((n, program.n_codebooks), np.int64), np.arange(n), [0, n], [n], [table], 1
            )
            lays.append(prefill_layout(pre, rows, 1, page))
        q = torch.randn(k * rows, program.num_qo_heads, program.head_dim, device=kv_cache.device).to(
            program.dtype
        )
        want = []
        for j, lay in enumerate(lays):
            attn.prepare_replay_prefill(single, lay, torch.from_numpy(lay.kv_indices).to(kv_cache.device))
            want.append(single.run(q[j * rows : (j + 1) * rows], cache))
        lay = joined_layout(lays)
        attn.prepare_replay_prefill(joined, lay, torch.from_numpy(lay.kv_indices).to(kv_cache.device))
        return bool(torch.equal(joined.run(q, cache), torch.cat(want)))
    except Exception:
        log.exception("checking %d prefill segments of %d rows planned as one failed", k, rows)
        return False


class PromptSegments:
    """Up to `count` segments of R rows per bucket R, one prompt each, each with arena spans
    (`kind`: their names' prefix) and an attention wrapper of its own, planned as its prefill
    graph plans it alone: the segments a batched graph or a mixed graph's joiners run in.
    `shared`: the buckets whose segments share a wrapper instead (their owner's), none by default."""

    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        arena: InputArena,
        attn: GraphAttentionBackend,
        buckets: list[int],
        count: int,
        max_pages: int,
        kind: str = "b",
        shared: Collection[int] = (),
    ) -> None:
        self.program, self.kv_cache, self.arena, self.attn = program, kv_cache, arena, attn
        self.page_size = kv_cache.shape[3]
        self.buckets, self.count, self.kind = sorted(buckets, reverse=True), count, kind
        self.wrappers: dict[int, list] = {}
        empty = empty_prefill(program.n_codebooks)
        for rows in (r for r in self.buckets if r not in shared):
            lay = prefill_layout(empty, rows, 1, self.page_size)
            self.wrappers[rows] = [
                attn.prepare_capture_prefill(rows, 1, max_pages, lay) for _ in range(count)
            ]

    def prefix(self, rows: int, j: int) -> str:
        return segment_prefix(rows, j, self.kind)

    def views(self, rows: int, k: int) -> SegmentViews:
        """The arena views of the first k segments of bucket `rows`, as one batch of k x rows rows."""
        a, c, xs = self.arena, self.program.n_codebooks, [self.prefix(rows, j) for j in range(k)]

        def cat(name: str, n: int) -> torch.Tensor:
            return torch.cat([a.dev_view(x + name, n) for x in xs])

        last = torch.cat([a.dev_view(x + "last", 1) + j * rows for j, x in enumerate(xs)])  # [k]
        return SegmentViews(
            cat("ids", rows * c).view(k * rows, c), cat("pos", rows), cat("where", 2 * rows),
            cat("page", rows), cat("off", rows), last,
        )  # fmt: skip

    def layouts(self, pres: list[StepBatch], rows: int) -> list[PrefillLayout]:
        return [prefill_layout(pre, rows, 1, self.page_size) for pre in pres]

    def fill(self, pres: list[StepBatch], lays: list[PrefillLayout], rows: int) -> None:
        for j, (pre, lay) in enumerate(zip(pres, lays, strict=True)):
            fill_prefill(self.arena, pre, lay, self.prefix(rows, j))

    def kv_indices(self, lays: list[PrefillLayout], rows: int) -> list[torch.Tensor]:
        """Each segment's page indices on the device (the arena's, as the step filled them)."""
        return [
            self.arena.dev_view(self.prefix(rows, j) + "kv", len(lay.kv_indices))
            for j, lay in enumerate(lays)
        ]

    def plan(self, lays: list[PrefillLayout], rows: int) -> None:
        own = self.wrappers[rows][: len(lays)]
        for wrapper, lay, kv in zip(own, lays, self.kv_indices(lays, rows), strict=True):
            self.attn.prepare_replay_prefill(wrapper, lay, kv)

    def end(self, rows: int, k: int) -> int:
        """Where the arena's spans of the first k segments of bucket `rows` end (what a step sends)."""
        return self.arena.end(self.prefix(rows, k - 1) + "kv")


@dataclass
class SegmentViews:
    """k segments' arena views as one batch (inside a graph a concatenation is a copy)."""

    ids: torch.Tensor  # [k * R, C]
    pos: torch.Tensor  # [k * R]
    where: torch.Tensor  # [2 * k * R]
    page: torch.Tensor  # [k * R]
    off: torch.Tensor  # [k * R]
    last: torch.Tensor  # [k]: each segment's last prompt row, counted over the k segments


class BatchedPrefill(PromptSegments):
    """The batched prefill graphs and their segments; `GraphRunner` owns the arena and calls
    place, fill, plan, replay."""

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
        # One attention wrapper for all of a graph's segments where the backend plans them as one
        # with each segment's bits (`segments_plan_as_one`: one kernel a layer, not one a segment)
        # and a check at startup finds the same bits (`joined_keeps_bits`); elsewhere a wrapper a
        # segment (`Segments`).
        self.joined: dict[tuple[int, int], object] = {}  # (k, rows) → the wrapper of k segments
        checked = {2, max_k}  # the segment counts the startup check plans
        for rows in (r for r in buckets if attn.segments_plan_as_one(r)):
            alone = prefill_layout(empty_prefill(program.n_codebooks), rows, 1, kv_cache.shape[3])
            lays = {k: joined_layout([alone] * k) for k in range(2, max_k + 1)}
            wrappers = {
                k: attn.prepare_capture_prefill(k * rows, 2 * k - 1, k * max_pages, lay)
                for k, lay in lays.items()
            }
            single = attn.prepare_capture_prefill(rows, 1, max_pages, alone)
            same = [joined_keeps_bits(program, kv_cache, attn, rows, k, wrappers[k], single) for k in checked]
            for k in checked:  # planned as at creation again: the check's pages are a scratch cache's
                kv = torch.from_numpy(lays[k].kv_indices).to(kv_cache.device)
                attn.prepare_replay_prefill(wrappers[k], lays[k], kv)
            if all(same):
                self.joined |= {(k, rows): w for k, w in wrappers.items()}
            else:
                log.warning(
                    "prefill segments of %d rows planned as one attend otherwise than alone: a wrapper each",
                    rows,
                )
        super().__init__(
            program, kv_cache, arena, attn, buckets, max_k, max_pages, shared={r for _, r in self.joined}
        )
        self.max_k = max_k  # capture (and replay) order: the buckets largest first
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
        p = self.program
        wrapper = self.joined.get((k, rows))
        if wrapper is None:
            wrapper = Segments(self.wrappers[rows][:k], rows)
        attn = GraphAttention(self.kv_cache, wrapper, None, None)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            v = self.views(rows, k)  # the segments' spans as one batch, inside the graph
            attn.page, attn.off = v.page, v.off  # every segment's write slots
            rows_k = rows_of(v.where.view(-1, 2), prompt_rows=k * rows)  # every row a prompt row
            hidden = p.backbone(p.embed(v.ids, rows_k), v.pos, attn)[v.last]  # [k, H]
            return segment_heads(p, hidden), hidden  # [k, C', V], [k, H]

        return capture(step, pool)

    # --- a step --------------------------------------------------------------------------------
    def place(self, rows: list[int], lane_buckets, lanes: int, join: int = 0) -> Placement | None:
        """Where prompts of `rows` rows (a step's, in order) run: see the module docstring (`join`:
        how many may join lane 0's in its mixed graph). None when they need more lanes than `lanes`
        or a prompt fits no prefill graph."""
        out = Placement()
        by_bucket: dict[int, list[int]] = {}
        first = None
        for i, n in enumerate(rows):
            bucket = pick_bucket(lane_buckets, 1, n)
            if bucket is None:
                return None
            if i == 0:
                out.lanes.append(i)
                first = bucket[0]
            elif bucket[0] == first and len(out.joiners) < join and first in self.buckets:
                out.joiners.append(i)
            elif bucket[0] not in self.buckets:
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

    def plan(self, lays: list[PrefillLayout], rows: int) -> None:
        wrapper = self.joined.get((len(lays), rows))
        if wrapper is None:
            return super().plan(lays, rows)
        # the segments' page indices side by side on the device, as the joined layout counts them
        kv = torch.cat(self.kv_indices(lays, rows))
        self.attn.prepare_replay_prefill(wrapper, joined_layout(lays), kv)

    def replay(self, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph, out = self.graphs[k, rows]
        graph.replay()
        return out[0], out[1]  # [k, C', V], [k, H]


def segment_heads(program: LMProgram, hidden: torch.Tensor) -> torch.Tensor:
    """[k, H] → [k, C', V]: each prompt's head on its own row, as in its prefill graph ([1, H])."""
    return torch.cat([program.head(hidden[j : j + 1]).float() for j in range(hidden.shape[0])])


def in_request_order(
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A step's prefill outputs, each (request indices, logits [n, C', V], hidden [n, H]), as
    lists of logits and hidden states in request order (lanes run in order; a batched graph takes
    its requests out of it: then one gather each). The gather's index goes to the device through
    pinned memory: a copy from pageable memory (`torch.tensor(..., device=...)`) would hold the
    host until the device has run every pass queued before it, this step's prefill graphs
    included, so that the host could not lay out the next step meanwhile."""
    ix = [i for part, _, _ in parts for i in part]
    logits, hiddens = [lg for _, lg, _ in parts], [h for _, _, h in parts]
    if ix == sorted(ix):
        return logits, hiddens
    order = torch.tensor(sorted(range(len(ix)), key=ix.__getitem__), dtype=torch.int64)
    where = to_device(order, logits[0].device)
    return [torch.cat(logits)[where]], [torch.cat(hiddens)[where]]
