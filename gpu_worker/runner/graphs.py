"""CUDA graphs: `lm_decode` per batch-size bucket and `lm_mixed` per (decode bucket, prefill bucket)
here, `lm_prefill` per row bucket in `gpu_worker.runner.prefill_graphs`, and the `GraphRunner` that
replays them.

Every graph reads one device input arena (`gpu_worker.runner.arena`: token ids, positions, KV write
slots, meta), filled from a pinned host mirror with a single host→device copy per step, and
attention from the graphs' backend (`gpu_worker.attention.interface.GraphAttentionBackend`), whose
`prepare_capture_*` hooks build what a graph captures and whose `prepare_replay_*` hooks plan it
again before each replay. Decode padding entries (bucket larger than the batch) decode
token 0 at position 0, write their key/value into the reserved page 0 and attend to it alone:
harmless work whose logits are dropped. A step's new requests each replay a prefill graph of their
own lane (padded the same way), or run eagerly together when they fit no bucket; its decode rows then
replay a decode graph.

A guided program's request (programs.base: Classifier-free guidance) runs S = 2 KV sequences side
by side: a decode graph of bucket B holds its S·B sequences' rows (each request's conditional, then
its unconditional row) and returns the B requests' paired logits (`gpu_worker.runner.batch.paired`,
inside the graph), a prompt's prefill graph holds both sequences, and the attention backend keeps
a sequence's pages at its own slot (`sequence_slots`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.graphs import capture
from gpu_worker.attention.interface import GraphAttention, SplitRows
from gpu_worker.attention.select import graph_attention
from gpu_worker.runner.arena import InputArena, decode_spans, fill_decode
from gpu_worker.runner.batch import StepBatch, kv_sequences, paired, rows_of, sequence_slots
from gpu_worker.runner.batched_prefill import (
    MAX_BATCHED,
    MIXED_JOINERS,
    BatchedPrefill,
    Placement,
    PromptSegments,
    Segments,
    batched_prefill_enabled,
    batched_spans,
    in_request_order,
    segment_heads,
)
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import pages_for
from gpu_worker.runner.prefill_graphs import (
    PrefillGraphs,
    PrefillLayout,
    fill_prefill,
    lane_prefix,
    max_prefill_pages,
    pick_bucket,
    prefill_buckets,
    prefill_spans,
)
from programs.base import LMProgram, Rows
from programs.blocks import fp8

log = logging.getLogger(__name__)

# New requests one step may start, each in a prefill graph of its own (one lane of graphs each).
# With one lane a burst of arrivals queues a step apiece: on the H200 at 192 streams a prompt waits
# p50 36 / p99 158 ms to be admitted with one lane, 15 / 39 ms with four.
PREFILL_LANES = 4
# A step's first new request, when its prompt fits a prefill bucket of at most this many rows, runs
# in one graph with the step's decode rows (`lm_mixed`, one per decode bucket and such prefill
# bucket) instead of a prefill graph of its own: on the H200 a 3B forward pass costs ~3 ms at
# a few rows whatever they are (kernel launches and weight reads), and ~12 us per row more beyond,
# so a prompt riding along a decode step costs less than a pass of its own: with float8 weights,
# whose GEMMs take both parts' rows at once, a 40-token prompt added 1.6 ms to a step of 384 streams
# (3.3 ms in a lane's graph, or with each GEMM run twice as bf16 weights need; bench/profile_step.py).
# Where the GEMMs are float8, up to MIXED_JOINERS more prompts of its bucket join it there, each in a
# segment of its own (gpu_worker.runner.batched_prefill).
MIXED_PREFILL_ROWS = 128


def bucket_for(sizes: list[int], n: int) -> int:
    """The smallest of the ascending bucket `sizes` that holds n rows."""
    return next(s for s in sizes if s >= n)


def decode_buckets(max_batch: int, min_batch: int = 1) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 beyond: padding stays under ~12 %.
    Sizes below `min_batch` are dropped (their batches pad up to the first size kept)."""
    sizes, b = [], 1
    while b < 8:
        sizes.append(b)
        b *= 2
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 128 else 32
    min_batch = min(min_batch, max_batch)
    return sorted({*(s for s in sizes if min_batch <= s < max_batch), max(min_batch, max_batch)})


@dataclass
class _Parts:
    """How a step splits over the graphs: its prefill part and its decode part, each request of the
    prefill part in a lane of its own (`pres`, `lays`; none when the prefill runs eagerly), the
    decode bucket, the decode part's attention layout, and how much of the arena the step sends."""

    n_pre: int
    n_dec: int
    pre: StepBatch | None
    dec: StepBatch | None
    pres: list[StepBatch]
    lays: list[PrefillLayout]
    order: list[int] = field(default_factory=list)  # the request each lane runs
    # batched prefill graphs: bucket rows → (request indices, their layouts), in replay order
    batched: dict[int, tuple[list[int], list[PrefillLayout]]] = field(default_factory=dict)
    # the requests joining lane 0's in the mixed graph, and their layouts
    joiners: tuple[list[int], list[PrefillLayout]] = field(default_factory=lambda: ([], []))
    bs: int = 0
    kv: Any = None
    kv_indices: np.ndarray | None = None
    upto: int = 0

    @property
    def n_kv(self) -> int:
        return 0 if self.kv_indices is None else len(self.kv_indices)


class GraphRunner:
    """Replays a prefill graph per new request of a step (each in its own lane; eager when they fit
    no graph) and a decode graph for its fed-back rows, from one input arena sent with one
    host→device copy."""

    # one new request per lane, more with batched prefill graphs; the engine admits no more
    # (`prompt_groups`)
    max_prefills_per_step = PREFILL_LANES

    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        limits,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.program = program
        self.kv_cache = kv_cache
        self.page_size = kv_cache.shape[3]
        self.sizes = decode_buckets(limits.max_batch_size, limits.min_decode_batch)
        self.row_tile = limits.decode_row_tile
        # A step lays its meta out as [3, bucket], padding rows on the scratch slot
        # (gpu_worker.runner.slots.SlotState), so that the bucket's captured sampling step can read
        # it (`sampling_inputs`); that bucket, else 0 (a guided program's step with prompts).
        self.scratch_slot = limits.max_batch_size
        self.sample_bucket = 0
        bmax, c, dev = self.sizes[-1], program.n_codebooks, program.device
        # KV sequences a request: decode graphs hold S rows a request, a prompt's graph S sequences
        self.sequences = s = kv_sequences(program)
        buckets = prefill_buckets(s * limits.max_context, s)
        rows, reqs = buckets[-1]
        p_pages = max_prefill_pages(rows, reqs, limits.max_context, self.page_size)
        max_pages = s * (bmax * pages_for(limits.max_context, self.page_size) + bmax)
        eager_attn, self.attn = graph_attention(program, kv_cache, limits, s * bmax, max_pages, s)
        self.eager = EagerRunner(program, eager_attn)
        spans = decode_spans(bmax, c, self.attn.decode_index_span(max_pages), s)
        for lane in range(PREFILL_LANES):
            spans |= prefill_spans(rows, reqs, c, p_pages, lane)
        # Prompts of one small bucket share a forward pass where the GEMMs allow (float8): up to
        # --max-prefills of them (MAX_BATCHED by default) in one batched graph.
        max_k = limits.max_prefills or MAX_BATCHED
        batched_rows = [r for r, _ in buckets if r <= MIXED_PREFILL_ROWS]
        batched = batched_prefill_enabled(program, limits) and max_k >= 2 and s == 1  # none pairs
        b_pages = max_prefill_pages(MIXED_PREFILL_ROWS, 1, limits.max_context, self.page_size)
        mixed = program.mixed_prefill and limits.mixed_prefill and not self.row_tile
        if batched:
            spans |= batched_spans(batched_rows, max_k, c, b_pages)
            if mixed:
                spans |= batched_spans(batched_rows, MIXED_JOINERS, c, b_pages, "m")
        self.arena = InputArena(spans, dev)
        # One memory pool for all graphs. Prefill graphs are captured first, lane by lane: a step
        # replays its prefill graphs in lane order, then its decode graph, and graphs sharing a pool
        # must replay in capture order, so that no graph's scratch memory holds an output that is
        # still to be read.
        self.pool = torch.cuda.graph_pool_handle()
        self.prefills = [
            PrefillGraphs(
                program, kv_cache, self.arena, self.attn, self.pool, buckets, p_pages, progress, lane
            )
            for lane in range(PREFILL_LANES)
        ]
        self.prefill = self.prefills[0]
        self.batched: BatchedPrefill | None = None  # captured after the lanes, replayed after them
        # the segments of prompts joining lane 0's in a mixed graph
        self.joiners: PromptSegments | None = None
        if batched:
            self.batched = BatchedPrefill(
                program, kv_cache, self.arena, self.attn, self.pool, batched_rows, max_k, b_pages, progress
            )
            self.max_prefills_per_step = PREFILL_LANES + len(batched_rows) * max_k
            if mixed:
                self.joiners = PromptSegments(
                    program, kv_cache, self.arena, self.attn, batched_rows, MIXED_JOINERS, b_pages, "m"
                )
                self.max_prefills_per_step += MIXED_JOINERS
        # bucket → (graph, attention wrapper, (logits [bs, C', V], hidden [bs, H]))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._capture_decode(progress)
        # (decode bucket, prefill rows, prompts) → (graph, the prompts' logits [k, C', V] and hidden
        # [k, H], then the decode rows' [bs, C', V] and [bs, H])
        self.mixed: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        # Every mixed graph's decode rows' logits, in one buffer (`_capture_mixed`)
        self._mixed_dec_logits: torch.Tensor | None = None
        # With row tiles the decode rows run in decode graphs only (a mixed graph's rows are untiled).
        self._capture_all_mixed(mixed, progress)
        self.depth = None
        if program.n_codebooks > 1:
            from gpu_worker.runner.depth_graphs import DepthGraphs, compiled_step

            compiled = compiled_step(program, limits.depth_compile, limits.cuda_graphs)
            self.depth = DepthGraphs(
                program, self.sizes, progress, compiled, limits.depth_compile == "auto", self.scratch_slot
            )

    # --- capture -------------------------------------------------------------------------------
    def _capture_decode(self, progress: Callable[[str], None] | None) -> None:
        """A decode graph per bucket, the largest first (after every lane's prefill graphs)."""
        t0 = time.monotonic()
        for i, bs in enumerate(sorted(self.sizes, reverse=True)):
            if progress:
                progress(f"capturing decode graphs: batch {bs} ({i + 1}/{len(self.sizes)})")
            # built (and planned once) outside inference mode, where the graph's own tensors are not
            n = self.sequences * bs  # rows
            wrapper = self.attn.prepare_capture_decode(n, self.arena.dev_view("pos", n))
            self.graphs[bs] = self._capture(bs, wrapper)
        log.info(
            "captured %d decode graphs (batch %s, attention on %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            self.attn.name,
            time.monotonic() - t0,
        )

    @torch.inference_mode()
    def _capture(
        self, bs: int, wrapper
    ) -> tuple[torch.cuda.CUDAGraph, object, tuple[torch.Tensor, torch.Tensor]]:
        p, c, a, s = self.program, self.program.n_codebooks, self.arena, self.sequences
        n = s * bs  # rows: each request's sequences
        ids, pos = a.dev_view("ids", n * c).view(n, c), a.dev_view("pos", n)
        where = a.dev_view("where", 2 * n).view(n, 2)
        attn = GraphAttention(self.kv_cache, wrapper, a.dev_view("page", n), a.dev_view("off", n))

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            self.attn.in_graph(wrapper)
            # --decode-row-tile (0: one GEMM): the backbone's GEMMs and the head's, which rounds a
            # row by the batch too (the audio head on the H200 from 40 rows)
            with fp8.row_tiles(self.row_tile):
                hidden = p.backbone(p.embed(ids, rows_of(where, prompt_rows=0)), pos, attn)  # [n, H]
                logits = p.head(hidden).float()
            return paired(p, logits, hidden, where[:, 0], s)  # [bs, C', V], [bs, H]

        graph, out = capture(step, self.pool)
        return graph, wrapper, out

    def _capture_all_mixed(self, enabled: bool, progress: Callable[[str], None] | None) -> None:
        """A mixed graph per decode bucket and prefill bucket of at most MIXED_PREFILL_ROWS rows, and
        per number of joiners where prompts join lane 0's (0 to MIXED_JOINERS), when `enabled`
        (captured last: a step replays its mixed graph after any other lane's prefill graph)."""
        mixed_rows = sorted((r for r in self.prefill.graphs if r <= MIXED_PREFILL_ROWS), reverse=True)
        if not enabled:
            mixed_rows = []
        t0 = time.monotonic()
        for i, bs in enumerate(sorted(self.sizes, reverse=True)):
            if progress:
                progress(f"capturing mixed prefill+decode graphs: batch {bs} ({i + 1}/{len(self.sizes)})")
            for rows in mixed_rows:
                joins = 0 if self.joiners is None or rows not in self.joiners.wrappers else MIXED_JOINERS
                for j in range(joins + 1):
                    self.mixed[bs, rows, 1 + j] = self._capture_mixed(bs, rows, j)
        log.info("captured %d mixed graphs (prefill rows %s, up to %d prompts) in %.1f s", len(self.mixed),
                 mixed_rows, 1 + (MIXED_JOINERS if self.joiners else 0), time.monotonic() - t0)  # fmt: skip

    @torch.inference_mode()
    def _capture_mixed(
        self, bs: int, rows: int, joiners: int = 0
    ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """One forward pass over lane 0's prefill rows (bucket `rows`, one request), `joiners` more
        prompts of that bucket in segments of their own and `bs` decode rows, reading every part's
        arena spans and planned wrappers: → logits and hidden states of each request's last row,
        then of the decode rows. Each row rounds as in the prefill graph and the decode graph it
        replaces, so a request's tokens do not depend on who arrived with it: bf16 GEMMs keep the
        two parts apart (`fp8.rows_apart`; joiners exist only for row-invariant GEMMs), float8 ones give
        a row the same bits at any row count, and each prompt and the decode part have heads of
        their own."""
        p, c, a, s = self.program, self.program.n_codebooks, self.arena, self.sequences
        lane = self.prefill
        x, n, k = lane.prefix, s * bs, 1 + joiners  # n decode rows: each request's sequences
        ids = [a.dev_view(x + "ids", rows * c).view(rows, c), a.dev_view("ids", n * c).view(n, c)]
        pos = [a.dev_view(x + "pos", rows), a.dev_view("pos", n)]
        where = [a.dev_view(x + "where", 2 * rows), a.dev_view("where", 2 * n)]
        page = [a.dev_view(x + "page", rows), a.dev_view("page", n)]
        off = [a.dev_view(x + "off", rows), a.dev_view("off", n)]
        last = a.dev_view(x + "last", s)  # the prompt's last row of each sequence
        decode = self.graphs[bs][1]  # the decode graph's wrapper: it reads the same spans
        prefill = lane.graphs[rows][1]
        if joiners:
            prefill = Segments([prefill, *self.joiners.wrappers[rows][:joiners]], rows)
        attn = GraphAttention(self.kv_cache, SplitRows(prefill, decode, k * rows), None, None)

        def step() -> tuple[torch.Tensor, ...]:
            self.attn.in_graph(decode)
            ids_, pos_, where_, page_, off_ = (list(views) for views in (ids, pos, where, page, off))
            heads = last
            if joiners:  # the joiners' spans after lane 0's, as one batch (in the graph: copies)
                v = self.joiners.views(rows, joiners)
                joined = (v.ids, v.pos, v.where, v.page, v.off)
                for part, extra in zip((ids_, pos_, where_, page_, off_), joined, strict=True):
                    part.insert(1, extra)
                heads = torch.cat([last, v.last + rows])
            attn.page, attn.off = torch.cat(page_), torch.cat(off_)  # every part's write slots, in the graph
            w = torch.cat(where_).view(-1, 2)
            with fp8.rows_apart(k * rows):
                emb = p.embed(torch.cat(ids_), rows_of(w, prompt_rows=k * rows))
                hidden = p.backbone(emb, torch.cat(pos_), attn)  # [k * rows + n, H]
            pre, dec = hidden[heads], hidden[k * rows :]  # [s + joiners, H], [n, H]
            # lane 0's request: its [1, H] (a guided request's S sequences paired), then the joiners'
            pre_logits, first = paired(p, p.head(pre[:s]).float(), pre[:s], w[last, 0], s)
            if joiners:
                pre_logits = torch.cat([pre_logits, segment_heads(p, pre[s:])])
                first = torch.cat([first, pre[s:]])
            dec_logits, dec = paired(p, p.head(dec).float(), dec, w[k * rows :, 0], s)
            return pre_logits, first, self._shared_dec_logits(dec_logits), dec

        return capture(step, self.pool)

    def _shared_dec_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [n, C', V] copied into the first n rows of the buffer every mixed graph writes its
        decode rows' logits to. A step replays one mixed graph and `forward` reads its outputs on
        the stream before anything replays again, so one buffer serves them all; a graph's own
        output would stay allocated in the pool for each (decode bucket, prompt bucket, joiners):
        with the full head (156,940 columns, float32) some 10 GB at a batch of 256. The buffer is
        made at the first (largest) graph's warm-up, outside the capture."""
        buf = self._mixed_dec_logits
        if buf is None or buf.shape[0] < logits.shape[0] or buf.shape[1:] != logits.shape[1:]:
            if logits.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the mixed graphs' logits buffer is made at a warm-up, not in a capture")
            buf = self._mixed_dec_logits = torch.empty_like(logits)
        out = buf[: logits.shape[0]]
        out.copy_(logits)
        return out

    # --- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """→ (logits [B, C', V] float32, meta [3, B] on the device, hidden [B, H] or None; see
        EagerRunner): the prefill part from a graph (or eagerly when no bucket holds it), the
        decode part from a graph.
          1. lay the step out over the graphs;
          2. fill the arena and send it with one copy;
          3. plan every graph's attention (their own buffers), then mark the copies done;
          4. replay: prefill graphs in lane order, then the decode (or mixed) graph.
        A guided program's batch laid out one sequence a request (a step that only times the work)
        runs as its guided step would (`StepBatch.as_sequences`)."""
        b = b.as_sequences(self.sequences)
        n_pre = b.num_prefill  # sequences
        if b.meta is not None and n_pre:  # new requests bring their sequences' pages
            slots = sequence_slots(b.meta[0, : n_pre // b.sequences], b.sequences)
            self.attn.admit(slots, b.page_tables[:n_pre])
        self.sample_bucket = 0
        if b.num_requests > self.sizes[-1]:
            return self.eager.forward(b)
        parts = self._lay_out(b)
        meta = self._fill(b, parts)
        self._plan(b, parts)
        return self._replay(b, parts, meta)

    def _lay_out(self, b: StepBatch) -> _Parts:
        """The step's requests (each with its sequences) over lanes, batched graphs and a decode bucket."""
        n_pre = b.num_prefill // b.sequences
        n_dec = b.num_requests - n_pre
        pre = b.part(0, n_pre) if n_pre else None
        dec = b.part(n_pre, b.num_requests) if n_dec else None
        # Each new request in a graph of its own lane, with lane 0's in the mixed graph, or in a
        # batched graph with others of its bucket; all eagerly when they fit no graphs.
        singles = [b.part(i, i + 1) for i in range(n_pre)]
        place = self.place([p.qo_indptr[-1] for p in singles], decoding=dec is not None)
        order = [] if place is None else place.lanes
        pres = [singles[i] for i in order]
        lays = [lane.layout(p) for lane, p in zip(self.prefills, pres, strict=False)]
        batched, joiners = {}, ([], [])
        if place is not None and self.batched is not None:
            batched = {
                r: (ix, self.batched.layouts([singles[i] for i in ix], r)) for r, ix in place.groups.items()
            }
        if place is not None and place.joiners:
            joiners = (place.joiners, self.joiners.layouts([singles[i] for i in place.joiners], lays[0].rows))
        if pre is not None and (place is None or any(lay is None for lay in lays)):
            pres, lays, order, batched, joiners = [], [], [], {}, ([], [])
        parts = _Parts(n_pre, n_dec, pre, dec, pres, lays, order, batched, joiners)
        a = self.arena
        if dec is not None:
            parts.bs = bucket_for(self.sizes, n_dec)
            pad = (parts.bs - n_dec) * b.sequences
            parts.kv = self.attn.decode_layout(dec.kv_lens + [1] * pad, dec.page_tables + [[0]] * pad)
            parts.kv_indices = self.attn.decode_indices(parts.kv)
        if lays:  # through the last lane used (the lanes' spans follow the decode spans, in order)
            parts.upto = sum(a.spans[lane_prefix(len(lays) - 1) + "kv"])
        else:
            parts.upto = a.spans["d_kv"][0] + parts.n_kv
        for r, (ix, _) in batched.items():  # the segments' spans follow the lanes'
            parts.upto = max(parts.upto, self.batched.end(r, len(ix)))
        if joiners[0]:  # ... and the joiners' follow theirs
            parts.upto = max(parts.upto, self.joiners.end(lays[0].rows, len(joiners[0])))
        return parts

    def place(self, rows: list[int], decoding: bool = True) -> Placement | None:
        """Where a step's prompts (of `rows` rows each, a guided prompt's both sequences', in order)
        run: each in a lane of its own, or with batched graphs and, where the step `decoding` runs
        the mixed graph, joining lane 0's (`BatchedPrefill.place`); None: not all in graphs (then
        eagerly)."""
        lanes, s = len(self.prefills), self.sequences
        if self.batched is not None and len(rows) > 1:
            join = MIXED_JOINERS if decoding and self.joiners is not None else 0
            return self.batched.place(rows, self.prefill.buckets, lanes, join)
        if len(rows) > lanes or any(pick_bucket(self.prefill.buckets, s, n) is None for n in rows):
            return None
        return Placement(lanes=list(range(len(rows))))

    def prompt_groups(self, rows: list[int]) -> int | None:
        """The groups prompts of `rows` rows each run in when they start together in graphs (each
        rounding as alone) beside decode rows: a lane each (lane 0's with the prompts joining it in
        the mixed graph), or a batched graph of several (`place`); None where the graphs do not take
        them together, with decode rows or without (all streams sitting the step out). A group reads
        the weights once: what its prompts cost beyond their rows
        (`gpu_worker.scheduler.step_cost.StepCost`)."""
        place = self.place(rows)
        if place is None or self.place(rows, decoding=False) is None:
            return None
        return len(place.lanes) + len(place.groups)

    def _fill(self, b: StepBatch, parts: _Parts) -> torch.Tensor | None:
        """One copy of the arena: decode rows, meta, and the prefill rows when a graph runs them →
        the step's meta [3, B] on the device (None without meta)."""
        a, dec = self.arena, parts.dec
        a.begin(parts.upto)
        if dec is not None:
            fill_decode(a, dec, self.page_size)
            if parts.kv_indices is not None:
                a.host_view("d_kv", parts.n_kv).copy_(torch.from_numpy(parts.kv_indices))
        meta = None
        if b.meta is not None and (parts.n_pre == 0 or b.sequences == 1):  # [3, bucket]: see sample_bucket
            n = b.meta.shape[1]  # requests
            bs = bucket_for(self.sizes, n)
            host = a.host_view("meta", 3 * bs).view(3, bs)
            host[:, :n].copy_(torch.from_numpy(b.meta))
            host[0, n:] = self.scratch_slot
            host[1:, n:] = 0  # in range: a padding row records at history position 0
            meta = self.padded_meta(bs)[:, :n]
            self.sample_bucket = bs
        elif b.meta is not None:
            a.host_view("meta", b.meta.size).copy_(torch.from_numpy(b.meta.reshape(-1)))
            meta = a.dev_view("meta", b.meta.size).view(3, -1)
        for lane, (p, lay) in enumerate(zip(parts.pres, parts.lays, strict=True)):
            fill_prefill(a, p, lay, lane)
        for r, (ix, lays) in parts.batched.items():
            self.batched.fill([b.part(i, i + 1) for i in ix], lays, r)
        ix, lays = parts.joiners
        if ix:
            self.joiners.fill([b.part(i, i + 1) for i in ix], lays, parts.lays[0].rows)
        a.send(parts.upto)
        return meta

    def _plan(self, b: StepBatch, parts: _Parts) -> None:
        """Plan every graph's attention (their own buffers), then mark the copies done."""
        for graphs, lay in zip(self.prefills, parts.lays, strict=False):
            graphs.plan(lay)
        for r, (_, lays) in parts.batched.items():
            self.batched.plan(lays, r)
        if parts.joiners[0]:
            self.joiners.plan(parts.joiners[1], parts.lays[0].rows)
        if parts.dec is not None:
            _, wrapper, _ = self.graphs[parts.bs]
            rows = (parts.dec.page_tables, parts.dec.kv_lens) if b.meta is None else None
            kv_indices = self.arena.dev_view("d_kv", parts.n_kv)
            self.attn.prepare_replay_decode(wrapper, parts.kv, kv_indices, rows)
        self.arena.seal()

    def _replay(
        self, b: StepBatch, parts: _Parts, meta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Prefill first (the capture order: lanes, then batched graphs), then decode; the first
        new request with the decode rows in a mixed graph when one holds them (captured last, so
        replayed last)."""
        lays, n_pre, n_dec, joiners = parts.lays, parts.n_pre, parts.n_dec, parts.joiners[0]
        mixed = None
        if lays and parts.dec is not None:
            mixed = self.mixed.get((parts.bs, lays[0].rows, 1 + len(joiners)))
        assert mixed is not None or not joiners, "prompts joined lane 0's where no mixed graph runs"
        pre: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (requests, logits, hidden)
        for graphs, lay, i in zip(self.prefills, lays, parts.order, strict=False):
            if mixed is not None and graphs is self.prefill:
                continue
            pre.append(([i], *graphs.replay(lay)))
        for r, (ix, _) in parts.batched.items():
            pre.append((ix, *self.batched.replay(len(ix), r)))
        if parts.pre is not None and not lays:
            parts.pre.meta = None  # already on the device, in the arena
            lg, _, hidden = self.eager.forward(parts.pre)
            pre.append((list(range(n_pre)), lg, hidden))
        dec: list[tuple[torch.Tensor, torch.Tensor]] = []
        if parts.dec is not None:
            a = self.arena
            if meta is not None:
                slots, s = meta[0, n_pre:], b.sequences  # the decode requests'
                if b.last_rows is not None:  # fed-back ids, gathered on the device (each sequence's)
                    a.dev_view("ids", s * n_dec * self.program.n_codebooks).view(s * n_dec, -1).copy_(
                        b.last_rows[slots].repeat_interleave(s, 0)
                    )
                self.attn.select_rows(sequence_slots(slots, s))
            if mixed is not None:
                graph, out = mixed
                graph.replay()
                pre.insert(0, ([parts.order[0], *joiners], out[0], out[1]))
                dec.append((out[2][:n_dec], out[3][:n_dec]))
            else:
                graph, _, out = self.graphs[parts.bs]
                graph.replay()
                dec.append((out[0][:n_dec], out[1][:n_dec]))
        logits, hiddens = in_request_order(pre)
        logits, hiddens = logits + [lg for lg, _ in dec], hiddens + [h for _, h in dec]
        hidden = None
        if self.program.n_codebooks > 1:
            hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        return (logits[0] if len(logits) == 1 else torch.cat(logits)), meta, hidden

    def padded_meta(self, bs: int) -> torch.Tensor:
        """[3, bs] device view of a step's meta laid out in bucket bs (see sample_bucket)."""
        return self.arena.dev_view("meta", 3 * bs).view(3, bs)

    def decode_logits(self, bs: int) -> torch.Tensor:
        """[bs, C', V] the logits of bucket bs's decode graph, rewritten by each replay."""
        return self.graphs[bs][2][0]

    def decode_hidden(self, bs: int) -> torch.Tensor:
        """[bs, H] the hidden states of bucket bs's decode graph, rewritten by each replay."""
        return self.graphs[bs][2][1]

    def sampling_inputs(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> int:
        """The bucket whose captured sampling step samples the step just run (0: none), its inputs
        in place: a decode-only step's logits and hidden states are that bucket's decode-graph
        outputs already; a step with prompts copies its own there (the bucket holds all its rows;
        the rows past them are padding, sampled on the scratch slot)."""
        bs = self.sample_bucket
        if bs and logits.data_ptr() != self.decode_logits(bs).data_ptr():  # not that graph's outputs
            n = logits.shape[0]
            self.decode_logits(bs)[:n].copy_(logits)
            if hidden is not None:
                self.decode_hidden(bs)[:n].copy_(hidden)
        return bs

    def decode_tokens(self, hidden: torch.Tensor, c0: torch.Tensor, rows, where: Rows) -> torch.Tensor:
        """The program's depth step from a captured graph (eager past the largest bucket)."""
        if hidden.shape[0] > self.sizes[-1]:
            return self.depth.eager(hidden, c0, rows, where)
        return self.depth.run(hidden, c0, rows, where)
