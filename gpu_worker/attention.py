"""The torch attention backend over the paged KV cache (CPU, and the eager reference for GPU).

The runtime plans it once per step with each request's rows, positions and page table; every
layer then calls `forward(layer, q, k, v)`, which scatters the step's keys/values into their pages
and attends causally over the request's whole context. A FlashInfer backend implements the same
`plan`/`forward` interface on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


class TorchPagedAttention:
    def __init__(self, kv_cache: torch.Tensor, num_qo_heads: int) -> None:
        self.kv_cache = kv_cache  # [L, P, 2, page, Hkv, D]
        self.page_size = kv_cache.shape[3]
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = kv_cache.shape[4]
        self._layout: StepLayout | None = None

    def plan(self, layout: StepLayout) -> None:
        dev = self.kv_cache.device
        page_of_row: list[int] = []
        for b, table in enumerate(layout.page_tables):
            lo, hi = layout.qo_indptr[b], layout.qo_indptr[b + 1]
            for p in layout.pos[lo:hi].tolist():
                page_of_row.append(table[p // self.page_size])
        self._layout = layout
        self._write_page = torch.tensor(page_of_row, dtype=torch.int64, device=dev)  # [N]
        self._write_off = layout.pos.to(dev) % self.page_size  # [N]
        self._tables = [torch.tensor(t, dtype=torch.int64, device=dev) for t in layout.page_tables]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        assert lay is not None, "plan() before forward()"
        cache = self.kv_cache[layer]  # [P, 2, page, Hkv, D]
        write_kv(cache, self._write_page, self._write_off, k, v)
        out = torch.empty_like(q)
        group = self.num_qo_heads // self.num_kv_heads
        for b, table in enumerate(self._tables):
            lo, hi = lay.qo_indptr[b], lay.qo_indptr[b + 1]
            n_kv = lay.kv_lens[b]
            kv = cache[table]  # [pages, 2, page, Hkv, D]
            keys = kv[:, 0].reshape(-1, self.num_kv_heads, kv.shape[-1])[:n_kv]  # [T, Hkv, D]
            vals = kv[:, 1].reshape(-1, self.num_kv_heads, kv.shape[-1])[:n_kv]
            if keys.element_size() == 1:  # an fp8 cache: attend in the queries' precision
                keys, vals = keys.to(q.dtype), vals.to(q.dtype)
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
            vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
            qb = q[lo:hi].transpose(0, 1)  # [Hq, n, D]
            # Row i of this request sits at position kv_len - n + i and sees keys [0, pos].
            n = hi - lo
            q_pos = torch.arange(n_kv - n, n_kv, device=q.device)
            mask = torch.arange(n_kv, device=q.device)[None, :] <= q_pos[:, None]  # [n, T]
            o = F.scaled_dot_product_attention(qb.to(keys.dtype), keys, vals, attn_mask=mask)
            out[lo:hi] = o.transpose(0, 1).to(out.dtype)
        return out
