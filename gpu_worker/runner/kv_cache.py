"""Paged KV cache storage and its page allocator.

Layout [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim], the layout FlashInfer's
paged kernels read (NHD, K and V interleaved per page). Page 0 is never handed out: padding rows
write their keys there, so garbage never lands in a live request's pages.
"""

from __future__ import annotations

import torch


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int] | None:
        """n pages, none of them in `avoid`, or None (and nothing taken) when fewer are free."""
        if not avoid:
            if n > len(self._free):
                return None
            return [self._free.pop() for _ in range(n)]
        picked = [i for i in range(len(self._free) - 1, -1, -1) if self._free[i] not in avoid][:n]
        if len(picked) < n:
            return None
        pages = [self._free[i] for i in picked]
        for i in picked:  # from the end: the indices still to delete stay valid
            del self._free[i]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def fit_pages(
    wanted: int, explicit: bool, page_bytes: int, free_bytes: int, reserve_bytes: int, least: int
) -> int:
    """KV pages that fit the device: `wanted` (page 0 included) where `free_bytes` less
    `reserve_bytes` (what must stay free: this worker's graphs and activations, the codec worker
    sharing the GPU) holds them, else as many as it holds when the count was not set by hand
    (`explicit`). Raises where fewer than `least` pages (one request's full context and page 0)
    fit, or where an explicit count does not."""
    room = (free_bytes - reserve_bytes) // page_bytes
    if wanted <= room:
        return wanted
    gib = 1 << 30
    what = (
        f"{wanted} KV pages ({wanted * page_bytes / gib:.1f} GiB) do not fit the GPU's "
        f"{free_bytes / gib:.1f} GiB free less the {reserve_bytes / gib:.1f} GiB of --gpu-memory-reserve"
    )
    if explicit:
        raise ValueError(f"{what}: lower --num-pages (0 = fit the device)")
    if room < least:
        raise ValueError(f"{what}, nor one request's full context: lower --max-context or the reserve")
    return int(room)


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """What keys/values are stored as: the model's dtype, or float8 e4m3 (unscaled)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return torch.float8_e4m3fn if name == "fp8" else model_dtype


def kv_page_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one page of `allocate_kv_cache`'s layout takes: keys and values of every layer."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # [L, P, 2, page, Hkv, D]
    return torch.zeros(
        num_layers, num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
