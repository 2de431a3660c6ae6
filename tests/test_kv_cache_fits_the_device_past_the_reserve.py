"""The KV cache on a GPU: `--max-batch-size` full contexts where the device's free memory, less
`--gpu-memory-reserve` (a share of the GPU's memory: the worker's graphs, the codec worker sharing the GPU), holds them; else as
many pages as it holds, or a clear error where not even one request's context fits or an explicit
`--num-pages` does not."""

from __future__ import annotations

import pytest

from common.config import GpuWorkerSettings
from gpu_worker.runner.kv_cache import fit_pages

GIB = 1 << 30
PAGE = 1 << 20  # bytes a page


def test_pages_that_fit_are_kept():
    assert fit_pages(1000, False, PAGE, 40 * GIB, 16 * GIB, 65) == 1000
    assert fit_pages(1000, True, PAGE, 40 * GIB, 16 * GIB, 65) == 1000


def test_the_cache_shrinks_to_what_the_device_holds_past_the_reserve():
    # 24 GiB past the reserve hold 24,576 pages of 1 MiB
    assert fit_pages(100_000, False, PAGE, 40 * GIB, 16 * GIB, 65) == 24 * 1024


def test_an_explicit_page_count_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="lower --num-pages"):
        fit_pages(100_000, True, PAGE, 40 * GIB, 16 * GIB, 65)


def test_no_room_for_one_request_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="nor one request's full context"):
        fit_pages(100_000, False, PAGE, 16 * GIB + 10 * PAGE, 16 * GIB, 65)


def test_the_reserve_is_a_setting_and_not_negative():
    assert GpuWorkerSettings().gpu_memory_reserve == 0.15
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--gpu-memory-reserve"):
            GpuWorkerSettings(gpu_memory_reserve=bad).check()


def test_a_pages_bytes_are_those_the_cache_allocates():
    import torch

    from gpu_worker.runner.kv_cache import allocate_kv_cache, kv_page_bytes

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = allocate_kv_cache(3, 5, 16, 2, 8, dtype, "cpu")
        assert kv_page_bytes(3, 16, 2, 8, dtype) * 5 == cache.numel() * cache.element_size()
