"""The attention interface every backend implements, and what backends and graphs share.

Two faces, one per way a step runs:

- eager (`EagerAttention`): `plan(layout)` once per step with the step's `StepLayout`, then
  `forward(layer, q, k, v)` per layer, which writes the rows' keys/values into their pages and
  attends (`TorchPagedAttention` on CPU, `FlashInferAttention` on GPU);
- captured (`GraphAttentionBackend`): the hooks through which `gpu_worker.runner.graphs.GraphRunner`
  captures and replays its graphs without knowing the kernels: `prepare_capture_*` builds (and
  plans once) what a graph of a given size captures, `prepare_replay_*` plans it again for the
  step about to replay it (after the step's inputs reach the device), `in_graph` runs inside the
  captured step before the layers, and `select_rows` runs on the device just before a decode
  replay. `gpu_worker.attention.flashinfer.FlashInferGraphs` and `gpu_worker.attention.xqa.XqaGraphs`
  implement them; `gpu_worker.attention.select` picks one.

`GraphAttention` is the attention a graph captures: it writes the rows' keys/values at the input
arena's write slots and runs the backend's wrapper; `SplitRows` joins a prefill wrapper and a
decode wrapper for a mixed step. `page_arrays` is the paged layout (CSR over pages) both FlashInfer
and the prefill graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class StepLayout:
    """Where this step's rows come from and go to. Rows of one request are contiguous."""

    qo_indptr: list[int]  # [B+1] row offsets per request
    kv_lens: list[int]  # [B] context length after this step's rows are written
    page_tables: list[list[int]]  # [B] page ids of each request, in order
    pos: torch.Tensor  # [N] int64 position of each row


def write_kv(
    cache: torch.Tensor, page: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Rows' keys and values k, v [N, Hkv, D] into one layer's cache [P, 2, page, Hkv, D] at
    (page[i], off[i]), converted to the cache's dtype. When v directly follows k in one buffer (the
    fused QKV projection's output, split), both go in one conversion and one scatter; else apart."""
    n, h, d = k.shape
    adjacent = (
        k.shape == v.shape
        and k.dtype == v.dtype
        and k.stride() == v.stride()
        and k.stride()[1:] == (d, 1)
        and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and v.data_ptr() - k.data_ptr() == h * d * k.element_size()
    )
    if adjacent:
        kv = k.as_strided((n, 2, h, d), (k.stride(0), h * d, d, 1))  # [N, 2, Hkv, D]
        cache[page, :, off] = kv.to(cache.dtype)
    else:
        cache[page, 0, off] = k.to(cache.dtype)
        cache[page, 1, off] = v.to(cache.dtype)


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


class EagerAttention(Protocol):
    """Attention of an eager step: planned once per step, then run per layer."""

    def plan(self, layout: StepLayout) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class AttentionWrapper(Protocol):
    """What a captured graph runs per layer: attention of q over one layer's cache."""

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor: ...


class GraphAttentionBackend(Protocol):
    """Attention in captured graphs: prefill graphs (ragged rows, causal) and decode graphs (one row
    per request), planned on the host and replayed. `DecodeKV` (Any below) is the backend's own
    host layout of a decode part, made before the step's arena copy."""

    name: str  # for the logs: the decode kernel

    def decode_index_span(self, max_pages: int) -> int:
        """Arena entries its decode plans read (page indices planned from the device), 0 if none."""
        ...

    def admit(self, slots: np.ndarray, page_tables: list[list[int]]) -> None:
        """New requests in `slots` bring their page tables (a request's pages never change)."""
        ...

    def prepare_capture_prefill(self, rows: int, reqs: int, max_pages: int, layout: Any) -> AttentionWrapper:
        """A prefill graph's attention over `rows` rows as `reqs` + 1 requests, planned on `layout`
        (the first plan fixes the row total)."""
        ...

    def prepare_capture_decode(self, batch: int, pos: torch.Tensor) -> AttentionWrapper:
        """A decode graph's attention for `batch` rows whose positions the graph reads at `pos`."""
        ...

    def segments_plan_as_one(self, rows: int) -> bool:
        """Whether prefill segments of `rows` rows, each a request and its padding entry as a prefill
        graph of one request lays them out (`reqs` 1), may share one wrapper planned over all of
        them (`prepare_capture_prefill` with 2k - 1 requests) and still attend each segment's rows to
        the same bits as a wrapper of its own: then a batched prefill graph runs one attention call
        a layer instead of one a segment."""
        ...

    def in_graph(self, wrapper: AttentionWrapper) -> None:
        """Inside a captured decode step, before the layers (device work captured with it)."""
        ...

    def decode_layout(self, kv_lens: list[int], page_tables: list[list[int]]) -> Any:
        """The host layout of a step's decode part (padded to its bucket), before the arena copy."""
        ...

    def decode_indices(self, kv: Any) -> np.ndarray | None:
        """The page indices of `kv` that go into the arena's decode index span, or None."""
        ...

    def prepare_replay_prefill(
        self, wrapper: AttentionWrapper, layout: Any, kv_indices: torch.Tensor
    ) -> None:
        """Plan a prefill graph's attention for this step; `kv_indices` on the device."""
        ...

    def prepare_replay_decode(
        self,
        wrapper: AttentionWrapper,
        kv: Any,
        kv_indices: torch.Tensor,
        rows: tuple[list[list[int]], list[int]] | None,
    ) -> None:
        """Plan a decode graph's attention for this step: `kv_indices` the arena's decode index span
        on the device; `rows` (page tables, context lengths) when the step has no sampling slots."""
        ...

    def select_rows(self, slots: torch.Tensor) -> None:
        """On the device, just before a decode replay: the decode rows are these slots [n]."""
        ...


class GraphAttention:
    """Attention as captured: writes the rows' keys/values to the arena's slots, runs one wrapper
    whose page-table buffers were fixed at construction and are refreshed by `plan` each step."""

    def __init__(self, kv_cache: torch.Tensor, wrapper, page: torch.Tensor, off: torch.Tensor) -> None:
        self.kv_cache, self.wrapper, self.page, self.off = kv_cache, wrapper, page, off

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_cache[layer]  # [P, 2, page, Hkv, D]
        write_kv(cache, self.page, self.off, k, v)
        return self.wrapper.run(q, cache)


class SplitRows:
    """Two attention wrappers as one, for a mixed step (`GraphAttention` takes it as its wrapper):
    its first `rows` rows are a prefill (a planned prefill wrapper), the rest decode rows."""

    def __init__(self, prefill, decode, rows: int) -> None:
        self.prefill, self.decode, self.rows = prefill, decode, rows

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        r = self.rows
        return torch.cat([self.prefill.run(q[:r], cache), self.decode.run(q[r:], cache)])
