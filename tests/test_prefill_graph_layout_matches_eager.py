"""The prefill-graph layout (row buckets, padding entries, arena contents) computes, on CPU with the
torch attention backend, the same logits and KV pages as the eager runner for the unpadded step.

The CUDA graph itself needs a GPU (tests/gpu/test_gpu_parity.py checks it there); this checks everything the
graph reads: the padded qo/kv page arrays FlashInfer is planned with, the write slots and the
last-row indices in the arena, and that padding rows (token 0, position 0, page 0) leave the real
requests' rows and pages untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention.interface import StepLayout
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.runner.arena import InputArena, decode_spans, fill_decode
from gpu_worker.runner.batch import StepBatch, rows_of
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache
from gpu_worker.runner.prefill_graphs import (
    fill_prefill,
    max_prefill_pages,
    pick_bucket,
    prefill_buckets,
    prefill_layout,
    prefill_spans,
)
from programs import get_spec, load_program_class

PAGE = 16
MAX_CONTEXT = 400


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    return p


def prefill_batch(lengths: list[int], seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    per = -(-MAX_CONTEXT // PAGE)
    # Pages handed out backwards and interleaved, so a wrong page table shows up.
    tables = [[1 + i + len(lengths) * k for k in range(per)][::-1] for i in range(len(lengths))]
    ids = rng.integers(0, 1000, size=(sum(lengths), 1)).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    qo = [0, *np.cumsum(lengths).tolist()]
    return StepBatch(ids, pos, qo, list(lengths), tables, len(lengths))


def arena_for(n_codebooks: int) -> InputArena:
    rows, reqs = prefill_buckets(MAX_CONTEXT, max_reqs=16)[-1]
    pages = max_prefill_pages(rows, reqs, MAX_CONTEXT, PAGE)
    return InputArena(
        {**decode_spans(8, n_codebooks), **prefill_spans(rows, reqs, n_codebooks, pages)}, "cpu"
    )


def graph_emulation(program, kv: torch.Tensor, pre: StepBatch) -> torch.Tensor:
    """What the captured prefill graph computes, with torch attention planned like FlashInfer."""
    c = program.n_codebooks
    bucket = pick_bucket(prefill_buckets(MAX_CONTEXT, max_reqs=16), pre.batch_size, pre.qo_indptr[-1])
    assert bucket is not None
    lay = prefill_layout(pre, *bucket, PAGE)
    rows, reqs = bucket
    arena = arena_for(c)
    arena.dev.fill_(-7)  # stale device contents must not matter: the whole prefix is sent
    arena.begin(arena.total)
    fill_prefill(arena, pre, lay)
    arena.send(arena.total)
    ids = arena.dev_view("p_ids", rows * c).view(rows, c)
    pos = arena.dev_view("p_pos", rows)
    last = arena.dev_view("p_last", reqs)
    kv_indices = arena.dev_view("p_kv", len(lay.kv_indices))
    ptr, lens = lay.kv_indptr, lay.kv_last
    kv_lens = [int((ptr[i + 1] - ptr[i] - 1) * PAGE + lens[i]) for i in range(reqs + 1)]
    tables = [kv_indices[ptr[i] : ptr[i + 1]].tolist() for i in range(reqs + 1)]
    attn = TorchPagedAttention(kv, program.num_qo_heads)
    attn.plan(StepLayout(lay.qo_indptr.tolist(), kv_lens, tables, pos))
    # The graph writes keys/values where the arena says; torch attention derives the same slots.
    assert attn._write_page.tolist() == arena.dev_view("p_page", rows).tolist()
    assert attn._write_off.tolist() == arena.dev_view("p_off", rows).tolist()
    where = rows_of(arena.dev_view("p_where", 2 * rows).view(rows, 2))
    hidden = program.backbone(program.embed(ids, where), pos, attn)
    return program.head(hidden[last]).float()[: pre.batch_size]


@pytest.mark.parametrize(
    "lengths",
    [[28], [40], [7, 33], [40, 40, 40, 40], [5] * 16, [300], [3, 250, 19], [MAX_CONTEXT - 1]],
)
def test_padded_prefill_layout_gives_eager_logits_and_pages(program, lengths):
    pre = prefill_batch(lengths, seed=len(lengths))
    shape = (program.num_layers, 1 + len(lengths) * (-(-MAX_CONTEXT // PAGE)), PAGE)
    kv_graph = allocate_kv_cache(*shape, program.num_kv_heads, program.head_dim, torch.float32, "cpu")
    kv_eager = allocate_kv_cache(*shape, program.num_kv_heads, program.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        got = graph_emulation(program, kv_graph, pre)
        want = EagerRunner(program, TorchPagedAttention(kv_eager, program.num_qo_heads)).forward(pre)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Real pages equal; page 0 holds the padding rows' garbage.
    torch.testing.assert_close(kv_graph[:, 1:], kv_eager[:, 1:], rtol=1e-5, atol=1e-5)


def test_prefill_buckets_start_small_and_hold_a_whole_context():
    # The default: one request per graph (batch invariance); the layout supports more.
    # By half a power of two up to 128 rows (a short prompt pads by at most a third), then doubling.
    assert prefill_buckets(1200) == [
        (32, 1), (48, 1), (64, 1), (96, 1), (128, 1), (256, 1), (512, 1), (1024, 1), (1536, 1)
    ]  # fmt: skip
    assert prefill_buckets(1200, max_reqs=16) == [
        (32, 2), (48, 3), (64, 4), (96, 6), (128, 8), (256, 16), (512, 16), (1024, 16), (1536, 16)
    ]  # fmt: skip
    for max_context in (100, 1200, 2048, 4096):
        buckets = prefill_buckets(max_context, max_reqs=16)
        assert buckets[-1][0] >= max_context + buckets[-1][1] + 1
        assert pick_bucket(buckets, 1, max_context) is not None


def test_pick_bucket_takes_the_smallest_that_fits_with_padding():
    b = prefill_buckets(1200, max_reqs=16)
    assert pick_bucket(b, 1, 28) == (32, 2)  # 28 rows + 1 one-row pad + the last entry's row
    assert pick_bucket(b, 1, 30) == (32, 2)
    assert pick_bucket(b, 1, 31) == (48, 3)
    assert pick_bucket(b, 1, 40) == (48, 3)  # a sentence's Orpheus prompt: 48 rows, not 64
    assert pick_bucket(b, 1, 46) == (64, 4)
    assert pick_bucket(b, 4, 160) == (256, 16)
    assert pick_bucket(b, 16, 640) == (1024, 16)
    assert pick_bucket(b, 17, 170) is None  # more requests than a graph takes: eager
    assert pick_bucket(b, 2, 1600) is None  # more rows than the largest bucket: eager
    for n in range(1, 17):
        for r in range(n, 1400, 7):
            got = pick_bucket(b, n, r)
            fits = [(rows, reqs) for rows, reqs in b if n <= reqs and r + reqs - n + 1 <= rows]
            assert got == (fits[0] if fits else None)


def test_prefill_layout_pads_with_one_row_entries_and_a_last_entry_on_page_0():
    pre = prefill_batch([3, 18], seed=0)
    pre.page_tables = [[5, 6], [7, 8]]
    lay = prefill_layout(pre, 64, 4, PAGE)
    # Two requests, two one-row padding entries, the last entry takes the remaining 41 rows.
    assert lay.qo_indptr.tolist() == [0, 3, 21, 22, 23, 64]
    assert lay.kv_indptr.tolist() == [0, 1, 3, 4, 5, 8]
    assert lay.kv_indices.tolist() == [5, 7, 8, 0, 0, 0, 0, 0]
    assert lay.kv_last.tolist() == [3, 2, 1, 1, 9]
    assert lay.page.tolist() == [5] * 3 + [7] * 16 + [8] * 2
    assert lay.off.tolist() == [0, 1, 2, *range(16), 0, 1]
    assert lay.last.tolist() == [2, 20]
    assert lay.qo_indptr.dtype == lay.kv_indptr.dtype == lay.kv_indices.dtype == np.int32
    full = prefill_layout(prefill_batch([30], seed=1), 32, 2, PAGE)  # no room left but the last row
    assert full.qo_indptr.tolist() == [0, 30, 31, 32]
    with pytest.raises(ValueError):
        prefill_layout(prefill_batch([31], seed=1), 32, 2, PAGE)


def test_one_arena_holds_decode_then_prefill_inputs_and_zero_padding():
    arena = arena_for(1)
    assert arena.spans["ids"][0] == 0 and arena.end("meta") == arena.spans["p_last"][0]
    assert arena.end("p_kv") == arena.total
    arena.host.fill_(5)
    arena.begin(arena.total)
    dec = StepBatch(np.array([[11], [12]]), np.array([17, 3]), [0, 1, 2], [18, 4], [[4, 9], [6]], 0)
    fill_decode(arena, dec, PAGE)
    pre = prefill_batch([3], seed=2)
    lay = prefill_layout(pre, 32, 2, PAGE)
    fill_prefill(arena, pre, lay)
    assert arena.host_view("ids", 3).tolist() == [11, 12, 0]
    assert arena.host_view("page", 3).tolist() == [9, 6, 0]
    assert arena.host_view("off", 3).tolist() == [1, 3, 0]
    assert arena.host_view("p_pos", 5).tolist() == [0, 1, 2, 0, 0]
    assert arena.host_view("p_page", 4).tolist() == [pre.page_tables[0][0]] * 3 + [0]
    assert arena.host_view("p_last", 2).tolist() == [2, 0]
    assert arena.host_view("p_kv", 4).tolist() == [pre.page_tables[0][0], 0, 0, 0]
    assert int(arena.host_view("p_ids")[3:].abs().sum()) == 0
