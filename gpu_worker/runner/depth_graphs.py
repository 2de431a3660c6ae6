"""CUDA graphs for a program's `decode_tokens` (depth transformers): one graph per decode bucket.

A depth step is dozens of tiny sequential kernels per codebook (a few transformer layers, a head
and the sampler, C - 1 times), so eager launches would dominate a decode step. Each bucket's graph
reads static buffers: the backbone's hidden states, the sampled codebook 0 and the per-row sampling
settings, copied in on the device (no host round trip); padding entries repeat the last step's
values, compute garbage and are dropped.

With --depth-compile, a program that has compilable pieces puts them under torch.compile itself
(`compile_depth`: e.g. one function for every position of a depth transformer, compiled in
seconds); for any other the whole step runs under torch.compile (dynamic batch, one compile for
every bucket, slow for a long unrolled step). Inductor's fused kernels are what each graph
captures, and the eager step of a batch past the largest bucket runs them too, so that a row
rounds the same way in either. On a GPU where compiling fails, "auto" captures the step
uncompiled, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.graphs import capture
from gpu_worker.runner.graphs import bucket_for
from gpu_worker.runner.sampler import SamplingRows, depth_sampler
from programs.base import LMProgram, Rows

log = logging.getLogger(__name__)

_FIELDS = ("temperature", "top_k", "top_p", "min_p", "rep_penalty", "seed", "counter", "block_stop")


def depth_step(
    program: LMProgram,
    hidden: torch.Tensor,
    c0: torch.Tensor,
    fields: tuple[torch.Tensor, ...],
    slot: torch.Tensor,
    step: torch.Tensor,
    prev: torch.Tensor,
) -> torch.Tensor:
    """The program's `decode_tokens` from plain tensors (`fields`: SamplingRows' _FIELDS, in order),
    so that torch.compile sees one function whatever the bucket."""
    rows = SamplingRows(**dict(zip(_FIELDS, fields, strict=True)), history=None, candidates=None)
    return program.decode_tokens(hidden, c0, depth_sampler(rows, program.n_codebooks), Rows(slot, step, prev))


def compiled_step(program: LMProgram, choice: str, graphs: bool) -> Callable[..., torch.Tensor] | None:
    """`depth_step` under torch.compile for --depth-compile `choice`, or None: "on" always, "auto"
    on a GPU with Triton and graphs, for a program with a depth step."""
    if choice == "off" or program.n_codebooks == 1:
        return None
    if choice == "auto":
        from torch.utils._triton import has_triton

        if not (program.device.type == "cuda" and graphs and has_triton()):
            return None
    if program.compile_depth(True):
        return depth_step  # the program compiles its own pieces (one small function, quick)
    return torch.compile(depth_step, dynamic=True)


class DepthGraphs:
    def __init__(
        self,
        program: LMProgram,
        sizes: list[int],
        progress: Callable[[str], None] | None = None,
        compiled: Callable[..., torch.Tensor] | None = None,
        fallback: bool = True,
        scratch_slot: int = 0,
    ) -> None:
        self.program = program
        # A bucket's padding entries belong to the scratch slot, so a program that writes per-slot
        # state in `decode_tokens` never writes a live request's from a padding row.
        self.scratch_slot = scratch_slot
        self.sizes = sizes
        self.step = compiled or depth_step
        self.compiled = compiled is not None
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
            slot=torch.full((bmax,), scratch_slot, **i64),
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
            try:
                self.graphs[bs] = self._capture(bs, pool)
            except Exception as e:  # a compile failure shows at the first capture's warm-up
                if not self.compiled or not fallback or isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                log.warning(
                    "depth step: compiling failed (%s: %s); capturing it uncompiled", type(e).__name__, e
                )
                program.compile_depth(False)
                self.step, self.compiled = depth_step, False
                self.graphs[bs] = self._capture(bs, pool)
        log.info(
            "captured %d depth graphs (%s) in %.1f s",
            len(sizes),
            "compiled" if self.compiled else "uncompiled",
            time.monotonic() - t0,
        )

    @torch.inference_mode()
    def _capture(self, bs: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        hidden, c0 = self.hidden[:bs], self.c0[:bs]
        fields = tuple(getattr(self.rows, f)[:bs] for f in _FIELDS)
        w = self.where
        slot, step, prev = w.slot[:bs], w.step[:bs], w.prev[:bs]
        return capture(lambda: self.step(self.program, hidden, c0, fields, slot, step, prev), pool)  # [bs, C]

    def eager(self, hidden: torch.Tensor, c0: torch.Tensor, rows: SamplingRows, where: Rows) -> torch.Tensor:
        """The same step without a graph (a batch past the largest bucket)."""
        fields = tuple(getattr(rows, f) for f in _FIELDS)
        return self.step(self.program, hidden, c0, fields, where.slot, where.step, where.prev)

    def run(self, hidden: torch.Tensor, c0: torch.Tensor, rows: SamplingRows, where: Rows) -> torch.Tensor:
        """hidden [n, H], c0 [n], rows and where (n entries) → [n, C] int64, from the smallest
        bucket ≥ n."""
        n = hidden.shape[0]
        bs = bucket_for(self.sizes, n)
        self.hidden[:n].copy_(hidden)
        self.c0[:n].copy_(c0)
        self.where.slot[:n].copy_(where.slot)
        self.where.slot[n:bs].fill_(self.scratch_slot)  # a larger batch's slots may linger there
        self.where.step[:n].copy_(where.step)
        self.where.prev[:n].copy_(where.prev)
        for f in _FIELDS:
            getattr(self.rows, f)[:n].copy_(getattr(rows, f))
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
