"""`write_kv` puts keys and values side by side in one scatter when they are neighbouring views of
the fused QKV projection's output, and apart otherwise; the cache ends the same either way."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpu_worker.attention.interface import write_kv


class _Scatters(TorchFunctionMode):
    """Counts tensor item assignments (each a scatter into the cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__:
            self.count += 1
        return func(*args, **(kwargs or {}))


N, HQ, HKV, D, PAGES, PAGE = 5, 6, 2, 8, 4, 4


def _reference(cache, page, off, k, v):
    cache[page, 0, off] = k.contiguous().to(cache.dtype)
    cache[page, 1, off] = v.contiguous().to(cache.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("order", ["q,k,v", "q,v,k", "apart"])
def test_keys_and_values_land_where_two_writes_put_them(dtype, order):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (HQ + 2 * HKV) * D, generator=g)
    if order == "apart":  # separate projections: nothing to share
        k, v = torch.randn(N, HKV, D, generator=g), torch.randn(N, HKV, D, generator=g)
    else:
        q, a, b = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        k, v = (a, b) if order == "q,k,v" else (b, a)  # v before k: not one [N, 2, Hkv, D] block
        k, v = k.view(N, HKV, D), v.view(N, HKV, D)
    page = torch.tensor([3, 1, 1, 0, 2])
    off = torch.tensor([0, 2, 3, 1, 3])
    got = torch.zeros(PAGES, 2, PAGE, HKV, D).to(dtype)
    want = got.clone()
    with _Scatters() as scatters:
        write_kv(got, page, off, k, v)
    assert scatters.count == (1 if order == "q,k,v" else 2)  # one scatter only for [k | v] neighbours
    _reference(want, page, off, k, v)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().sum() > 0


def test_views_that_only_look_like_neighbours_are_written_apart():
    qkv = torch.randn(N, (HQ + 2 * HKV) * D)
    _, a, b = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    k = a.view(N, HKV, D)
    page, off = torch.zeros(N, dtype=torch.int64), torch.arange(N) % PAGE
    other_dtype = b.view(torch.int32).view(N, HKV, D)  # the same bytes, read as integers
    with _Scatters() as scatters:
        write_kv(torch.zeros(PAGES, 2, PAGE, HKV, D), page, off, k, other_dtype)
    assert scatters.count == 2
    fewer_rows = b.view(N, HKV, D)[: N - 1]
    with _Scatters() as scatters, pytest.raises(RuntimeError):
        write_kv(torch.zeros(PAGES, 2, PAGE, HKV, D), page, off, k, fewer_rows)  # refused, not cut
    assert scatters.count == 2
