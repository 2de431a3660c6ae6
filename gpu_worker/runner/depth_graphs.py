"""CUDA graphs for a program's `decode_tokens` (depth transformers): one graph per decode bucket.

A depth step is dozens of tiny sequential kernels per codebook (a few transformer layers, a head
and the sampler, C - 1 times), so eager launches would dominate a decode step. Each bucket's graph
reads static buffers: the backbone's hidden states, the sampled codebook 0 and the per-row sampling
settings, copied in on the device (no host round trip); padding entries repeat the last step's
values, compute garbage and are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.graphs import capture
from gpu_worker.runner.sampler import SamplingRows, depth_sampler
from programs.base import LMProgram, Rows

log = logging.getLogger(__name__)

_FIELDS = ("temperature", "top_k", "top_p", "min_p", "rep_penalty", "seed", "counter", "block_stop")


class DepthGraphs:
    def __init__(
        self, program: LMProgram, sizes: list[int], progress: Callable[[str], None] | None = None
    ) -> None:
        self.program = program
        self.sizes = sizes
        bmax, dev = sizes[-1], program.device
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(bmax, program.hidden_size, dtype=program.dtype, device=dev)  # [bmax, H]
        self.c0 = torch.zeros(bmax, **i64)
        self.rows = SamplingRows(
            temperature=torch.zeros(bmax, **f32),
            top_k=torch.zeros(bmax, **i64),
            top_p=torch.ones(bmax, **f32),
            min_p=torch.zeros(bmax, **f32),
            rep_penalty=torch.ones(bmax, **f32),
            seed=torch.zeros(bmax, **i64),
            counter=torch.zeros(bmax, **i64),
            history=None,
            block_stop=torch.zeros(bmax, dtype=torch.bool, device=dev),
        )
        # Where each row belongs (programs.base.Rows): slot, step and the previous row.
        self.where = Rows(
            slot=torch.zeros(bmax, **i64),
            step=torch.zeros(bmax, **i64),
            prev=torch.zeros(bmax, program.n_codebooks, **i64),
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # A pool of its own: the backbone's graphs replay in their capture order within a shared
        # pool, and keeping the depth step apart leaves that order alone.
        pool = torch.cuda.graph_pool_handle()
        t0 = time.monotonic()
        for i, bs in enumerate(sorted(sizes, reverse=True)):
            if progress:
                progress(f"capturing depth graphs: batch {bs} ({i + 1}/{len(sizes)})")
            self.graphs[bs] = self._capture(bs, pool)
        log.info("captured %d depth graphs in %.1f s", len(sizes), time.monotonic() - t0)

    def _view(self, bs: int) -> SamplingRows:
        return SamplingRows(**{f: getattr(self.rows, f)[:bs] for f in _FIELDS}, history=None, candidates=None)

    @torch.inference_mode()
    def _capture(self, bs: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        hidden, c0, sample = self.hidden[:bs], self.c0[:bs], depth_sampler(self._view(bs))
        w = self.where
        where = Rows(slot=w.slot[:bs], step=w.step[:bs], prev=w.prev[:bs])
        return capture(lambda: self.program.decode_tokens(hidden, c0, sample, where), pool)  # out [bs, C]

    def run(self, hidden: torch.Tensor, c0: torch.Tensor, rows: SamplingRows, where: Rows) -> torch.Tensor:
        """hidden [n, H], c0 [n], rows and where (n entries) → [n, C] int64, from the smallest
        bucket ≥ n."""
        n = hidden.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.hidden[:n].copy_(hidden)
        self.c0[:n].copy_(c0)
        self.where.slot[:n].copy_(where.slot)
        self.where.step[:n].copy_(where.step)
        self.where.prev[:n].copy_(where.prev)
        for f in _FIELDS:
            getattr(self.rows, f)[:n].copy_(getattr(rows, f))
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
