"""FlashInfer attention over the paged KV cache: the GPU twin of `TorchPagedAttention`.

`plan` turns a step's layout into FlashInfer's page-table arrays (indptr, indices, last page
length) and plans the decode kernel (every request has one row) or the prefill kernel (ragged rows,
causal). `forward` writes the step's keys/values into their pages and runs the planned kernel on
that layer's cache. flashinfer is imported here only, so CPU installs never need it.
"""

from __future__ import annotations

import builtins
from types import ModuleType

import numpy as np
import torch

from gpu_worker.attention import StepLayout, write_kv

WORKSPACE_BYTES = 256 << 20


def _max(*args, **kw):
    """Python's max, except over one 1-D tensor: that is reduced in one call (same value)."""
    if len(args) == 1 and not kw and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
        return args[0].max()
    return builtins.max(*args, **kw)


def import_flashinfer() -> ModuleType:
    """flashinfer, with a faster `plan`. Its wrappers take `max(kv_lens)` with Python's max over a
    host tensor, one 0-d tensor comparison per request: ~2.5 ms of host time per step at batch 384
    (the unbind/select/gt/item rows of bench/results/h200-profile-step-b384-2026-11-29.txt). Its
    decode and prefill modules get a `max` that reduces such a tensor in one call."""
    import flashinfer

    for name in ("decode", "prefill"):  # submodules the package imports itself
        module = getattr(flashinfer, name, None)
        if isinstance(module, ModuleType):
            module.max = _max
    return flashinfer


def page_arrays(kv_lens: list[int], page_tables: list[list[int]], page_size: int) -> tuple[np.ndarray, ...]:
    """(kv_indptr [B+1], kv_indices [sum pages], last_page_len [B]) int32 for FlashInfer."""
    n_pages = [-(-n // page_size) for n in kv_lens]
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    np.cumsum(n_pages, out=indptr[1:])
    # One slice per request, not one Python step per page (13k pages at batch 400).
    parts = [np.asarray(table[:n], dtype=np.int32) for table, n in zip(page_tables, n_pages, strict=True)]
    indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    last = np.array([n - (k - 1) * page_size for n, k in zip(kv_lens, n_pages, strict=True)], dtype=np.int32)
    return indptr, indices, last


def plan_arrays(indptr: np.ndarray, last: np.ndarray, page_size: int, device: torch.device) -> dict:
    """A graph plan's host arrays as `plan` takes them (kv indptr, last page length, and the
    sequence lengths, from which it would otherwise build a tensor of its own), pinned on the GPU.
    `plan` copies them into the graph's buffers with non-blocking copies, and from pageable memory
    such a copy first waits for everything queued on the stream: the host would lose its lead."""
    seq_lens = np.maximum(np.diff(indptr) - 1, 0) * page_size + last
    out = {"indptr": indptr, "last": last, "seq_lens": seq_lens.astype(np.int32)}
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
    if torch.device(device).type == "cuda":
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


def write_slots(layout: StepLayout, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) int64 [N] where each row's key/value goes."""
    pos = layout.pos.cpu().numpy()
    page = np.empty(len(pos), dtype=np.int64)
    for b, table in enumerate(layout.page_tables):
        lo, hi = layout.qo_indptr[b], layout.qo_indptr[b + 1]
        page[lo:hi] = np.asarray(table, dtype=np.int64)[pos[lo:hi] // page_size]
    return page, pos % page_size


class FlashInferAttention:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_qo_heads: int,
        q_dtype: torch.dtype,
        tensor_cores: bool = True,
        decode_attention: str = "flashinfer",
    ) -> None:
        flashinfer = import_flashinfer()
        self.kv_cache = kv_cache  # [L, P, 2, page, Hkv, D]
        self.q_dtype = q_dtype  # queries and outputs: the model's dtype, whatever the cache holds
        self.page_size, self.num_kv_heads, self.head_dim = (
            kv_cache.shape[3],
            kv_cache.shape[4],
            kv_cache.shape[5],
        )
        self.num_qo_heads = num_qo_heads
        dev = kv_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # Tensor cores pay off for grouped-query attention (Llama-3.2-3B: 3 q heads per kv head).
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._wrapper = self.decode
        self.xqa = None  # decode steps on XQA instead (`decode_attention="xqa"`, resolved)
        if decode_attention == "xqa":
            from gpu_worker.xqa_backend import XqaDecode

            self.xqa = XqaDecode(kv_cache, num_slots=1, max_pages=1, max_batch=1)
        self._xqa_rows = 0  # > 0: this step decodes on XQA, this many rows

    def plan(self, layout: StepLayout) -> None:
        dev = self.kv_cache.device
        indptr, indices, last = page_arrays(layout.kv_lens, layout.page_tables, self.page_size)
        page, off = write_slots(layout, self.page_size)
        self._write_page = torch.from_numpy(page).to(dev, non_blocking=True)
        self._write_off = torch.from_numpy(off).to(dev, non_blocking=True)
        dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        qt, kt = self.q_dtype, self.kv_cache.dtype
        self._xqa_rows = 0
        if len(layout.qo_indptr) - 1 == len(layout.pos) and self.xqa is not None:
            self.xqa.set_rows(layout.page_tables, layout.kv_lens)
            self._xqa_rows = len(layout.kv_lens)
        elif len(layout.qo_indptr) - 1 == len(layout.pos):  # one row per request: decode
            self.decode.plan(
                torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), *dims,
                q_data_type=qt, kv_data_type=kt,
            )  # fmt: skip
            self._wrapper = self.decode
        else:
            qo = torch.from_numpy(np.asarray(layout.qo_indptr, dtype=np.int32))
            self.prefill.plan(
                qo, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), *dims,
                causal=True, q_data_type=qt, kv_data_type=kt,
            )  # fmt: skip
            self._wrapper = self.prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_cache[layer]  # [P, 2, page, Hkv, D]
        write_kv(cache, self._write_page, self._write_off, k, v)
        if self._xqa_rows:
            return self.xqa.run(q, cache, self._xqa_rows)
        return self._wrapper.run(q, cache)
