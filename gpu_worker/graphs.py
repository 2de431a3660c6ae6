"""CUDA graphs for decode steps: one captured graph per batch-size bucket.

Every graph reads one device *input arena* (token ids, positions, KV write slots), filled from a
pinned host mirror with a single host→device copy per step, and FlashInfer decode wrappers whose
page-table buffers are fixed at capture (`use_cuda_graph=True`); `plan` refreshes them before each
replay. Padding entries (bucket larger than the batch) decode token 0 at position 0, write their
key/value into the reserved page 0 and attend to it alone: harmless work whose logits are dropped.

Steps that bring prompt rows run their prefill part eagerly (FlashInfer's ragged prefill kernel),
and the decode part still replays a graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from gpu_worker.flashinfer_backend import WORKSPACE_BYTES, FlashInferAttention, page_arrays
from gpu_worker.kv_cache import pages_for
from gpu_worker.runner import EagerRunner, StepBatch
from programs.base import LMProgram

log = logging.getLogger(__name__)


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


class _GraphAttention:
    """Attention as captured: writes to the arena's slots, runs one wrapper."""

    def __init__(self, kv_cache: torch.Tensor, wrapper, page: torch.Tensor, off: torch.Tensor) -> None:
        self.kv_cache, self.wrapper, self.page, self.off = kv_cache, wrapper, page, off

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_cache[layer]
        cache[self.page, 0, self.off] = k
        cache[self.page, 1, self.off] = v
        return self.wrapper.run(q, cache)


class GraphRunner:
    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        limits,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        import flashinfer

        self.program = program
        self.kv_cache = kv_cache
        self.page_size = kv_cache.shape[3]
        self.eager = EagerRunner(program, FlashInferAttention(kv_cache, program.num_qo_heads))
        self.sizes = decode_buckets(limits.max_batch_size, limits.min_decode_batch)
        self.no_split_kv = limits.no_split_kv
        bmax, c, dev = self.sizes[-1], program.n_codebooks, program.device
        # Input arena: [ids (bmax*c) | pos | write page | write offset | meta (3*bmax)], int64;
        # meta (slot, tokens sampled, prompt length) covers every request of the step.
        self._spans = {"ids": (0, bmax * c), "pos": (bmax * c, bmax), "page": (bmax * (c + 1), bmax)}
        self._spans["off"] = (bmax * (c + 2), bmax)
        self._spans["meta"] = (bmax * (c + 3), 3 * bmax)
        total = bmax * (c + 6)
        self.host = torch.zeros(total, dtype=torch.int64).pin_memory()
        self.dev = torch.zeros(total, dtype=torch.int64, device=dev)
        max_pages = bmax * pages_for(limits.max_context, self.page_size) + bmax
        self.kv_indptr = torch.zeros(bmax + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(max_pages, dtype=torch.int32, device=dev)
        self.kv_last = torch.zeros(bmax, dtype=torch.int32, device=dev)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, tuple[torch.Tensor, torch.Tensor]]] = {}
        t0 = time.monotonic()
        for i, bs in enumerate(sorted(self.sizes, reverse=True)):
            if progress:
                progress(f"capturing decode graphs: batch {bs} ({i + 1}/{len(self.sizes)})")
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.kv_last[:bs],
            )
            self._plan(wrapper, *page_arrays([1] * bs, [[0]] * bs, self.page_size))
            self.graphs[bs] = self._capture(bs, wrapper)
        log.info(
            "captured %d decode graphs (batch %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            time.monotonic() - t0,
        )
        self.depth = None
        if program.n_codebooks > 1:
            from gpu_worker.depth_graphs import DepthGraphs

            self.depth = DepthGraphs(program, self.sizes, self.pool, progress)

    def _view(self, buf: torch.Tensor, name: str, n: int) -> torch.Tensor:
        lo, _ = self._spans[name]
        return buf[lo : lo + n]

    def _plan(self, wrapper, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray) -> None:
        p = self.program
        wrapper.plan(
            torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
            p.num_qo_heads, p.num_kv_heads, p.head_dim, self.page_size,
            q_data_type=self.kv_cache.dtype, kv_data_type=self.kv_cache.dtype, disable_split_kv=self.no_split_kv,
        )  # fmt: skip

    @torch.inference_mode()
    def _capture(
        self, bs: int, wrapper
    ) -> tuple[torch.cuda.CUDAGraph, object, tuple[torch.Tensor, torch.Tensor]]:
        p, c = self.program, self.program.n_codebooks
        ids = self._view(self.dev, "ids", bs * c).view(bs, c)
        pos = self._view(self.dev, "pos", bs)
        attn = _GraphAttention(
            self.kv_cache, wrapper, self._view(self.dev, "page", bs), self._view(self.dev, "off", bs)
        )

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = p.backbone(p.embed(ids), pos, attn)  # [bs, H]
            return p.head(hidden).float(), hidden  # [bs, C', V], [bs, H]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up: kernel selection and JIT happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph, wrapper, out

    @torch.inference_mode()
    def forward(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """→ (logits [B, C', V] float32, meta [3, B] on the device, hidden [B, H] or None; see
        EagerRunner): prefill part eager, decode part from a graph; one host→device copy of the
        arena carries the decode rows and all of meta."""
        n_dec = b.batch_size - b.num_prefill
        if n_dec > self.sizes[-1] or b.batch_size > self.sizes[-1]:
            return self.eager.forward(b)
        meta = self._fill_arena(b)
        parts, hiddens = [], []
        if b.num_prefill:
            pre = b.part(0, b.num_prefill)
            pre.meta = None  # already on the device, in the arena
            logits, _, hidden = self.eager.forward(pre)
            parts.append(logits)
            hiddens.append(hidden)
        if n_dec:
            dec_slots = meta[0, b.num_prefill :] if meta is not None else None
            logits, hidden = self._replay(b.part(b.num_prefill, b.batch_size), dec_slots)
            parts.append(logits)
            hiddens.append(hidden)
        hidden = None
        if self.program.n_codebooks > 1:
            hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), meta, hidden

    def decode_tokens(self, hidden: torch.Tensor, c0: torch.Tensor, rows) -> torch.Tensor:
        """The program's depth step from a captured graph (eager past the largest bucket)."""
        if hidden.shape[0] > self.sizes[-1]:
            return self.eager.decode_tokens(hidden, c0, rows)
        return self.depth.run(hidden, c0, rows)

    def _fill_arena(self, b: StepBatch) -> torch.Tensor | None:
        """Decode rows (padding zeroed) and the step's meta → one copy to the device arena."""
        self._copied.synchronize()  # the last step's copy out of the host arena is done
        self.host.zero_()  # padding rows: token 0, position 0, page 0, offset 0
        dec = b.part(b.num_prefill, b.batch_size)
        n, c = dec.batch_size, self.program.n_codebooks
        if n:
            self._view(self.host, "ids", n * c).copy_(torch.from_numpy(dec.ids.reshape(-1)))
            self._view(self.host, "pos", n).copy_(torch.from_numpy(dec.pos))
            pos = dec.pos
            page = np.fromiter(
                (t[p // self.page_size] for t, p in zip(dec.page_tables, pos, strict=True)), np.int64, n
            )
            self._view(self.host, "page", n).copy_(torch.from_numpy(page))
            self._view(self.host, "off", n).copy_(torch.from_numpy(pos % self.page_size))
        if b.meta is not None:
            self._view(self.host, "meta", b.meta.size).copy_(torch.from_numpy(b.meta.reshape(-1)))
        self.dev.copy_(self.host, non_blocking=True)
        self._copied.record()
        return None if b.meta is None else self._view(self.dev, "meta", b.meta.size).view(3, -1)

    def _replay(self, b: StepBatch, dec_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        n, c = b.batch_size, self.program.n_codebooks
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        if b.last_rows is not None:
            self._view(self.dev, "ids", n * c).view(n, c).copy_(b.last_rows[dec_slots])
        graph, wrapper, out = self.graphs[bs]
        self._plan(wrapper, *page_arrays(b.kv_lens + [1] * pad, b.page_tables + [[0]] * pad, self.page_size))
        graph.replay()
        return out[0][:n], out[1][:n]
