"""CPU checks of the pure pieces of the GPU path: graph buckets, FlashInfer page arrays, and the `max`
FlashInfer's plan is given."""

from __future__ import annotations

import numpy as np
import torch

from codec_worker.graphs import codec_buckets
from gpu_worker.attention.flashinfer import _max, page_arrays, plan_arrays, write_slots
from gpu_worker.attention.interface import StepLayout
from gpu_worker.runner.graphs import decode_buckets


def test_decode_buckets_cover_every_batch_size_with_little_padding():
    for max_batch in (1, 7, 16, 100, 256, 512):
        sizes = decode_buckets(max_batch)
        assert sizes[0] == 1 and sizes[-1] == max_batch and sizes == sorted(set(sizes))
        for n in range(1, max_batch + 1):
            bucket = next(s for s in sizes if s >= n)
            assert bucket - n <= max(7, n // 4)  # a few rows, or under a quarter, of padding
    assert decode_buckets(256, min_batch=32)[0] == 32


def test_codec_buckets_double_up_to_the_maximum():
    assert codec_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert codec_buckets(256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256]
    assert codec_buckets(100)[-1] == 100


def test_page_arrays_match_flashinfer_conventions():
    # kv lengths 1, 16, 17, 40 with page size 16 → 1, 1, 2, 3 pages; last page fill 1, 16, 1, 8.
    tables = [[5], [7, 8], [9, 10, 11], [2, 3, 4, 6]]
    indptr, indices, last = page_arrays([1, 16, 17, 40], tables, 16)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [5, 7, 9, 10, 2, 3, 4]
    assert last.tolist() == [1, 16, 1, 8]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    # What a graph's plan is handed (pinned on the GPU): the lengths it would derive itself.
    host = plan_arrays(indptr, last, 16, torch.device("cpu"))
    assert host["seq_lens"].tolist() == [1, 16, 17, 40] and host["seq_lens"].dtype == torch.int32
    assert host["indptr"].tolist() == indptr.tolist() and host["last"].tolist() == last.tolist()


def test_write_slots_put_each_row_in_its_page():
    pos = torch.tensor([0, 1, 2, 17, 40])
    layout = StepLayout([0, 3, 4, 5], [3, 18, 41], [[5], [7, 8], [2, 3, 4]], pos)
    page, off = write_slots(layout, 16)
    assert page.tolist() == [5, 5, 5, 8, 4]
    assert off.tolist() == [0, 1, 2, 1, 8]


def test_flashinfers_max_gives_pythons_value_in_one_reduction():
    lens = torch.tensor([5, 513, 17, 513, 2], dtype=torch.int32)
    assert _max(lens).item() == max(lens).item() == 513 and _max(lens).dim() == 0
    assert int(_max(lens[1:] - lens[:-1]).item()) == 508
    assert _max([3, 9, 4]) == 9 and _max(3, 9) == 9 and _max([], default=-1) == -1
    assert _max([torch.tensor(2), torch.tensor(7)]).item() == 7  # a list of tensors: Python's max
