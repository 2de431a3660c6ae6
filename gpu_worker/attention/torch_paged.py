"""The torch attention backend over the paged KV cache (CPU, and the eager reference for GPU).

The runtime plans it once per step with each request's rows, positions and page table; every
layer then calls `forward(layer, q, k, v)`, which scatters the step's keys/values into their pages
and attends causally over the request's whole context. A FlashInfer backend implements the same
`plan`/`forward` interface on GPU (gpu_worker.attention.interface.EagerAttention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention.interface import StepLayout, write_kv


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
