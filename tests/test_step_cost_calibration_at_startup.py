"""gpu_worker/scheduler/calibrate.py: the steps the engine times at startup differ in one part each, are
well-formed batches on pages of the cache, and their differences give `StepCost` each part: a prompt's
own cost apart from its group's where the runner's graphs run several prompts in one group."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.scheduler.calibrate import step_differences
from gpu_worker.scheduler.step_cost import StepCost

A, B, C, D, E = 3e-3, 10e-6, 12e-6, 0.4e-3, 1.5e-3
CODEBOOKS = 3


class Runner:
    """Decode buckets, and prompts grouped as by prefill lanes (a group each, at most 4)."""

    sizes = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]

    def prompt_groups(self, rows: list[int]) -> int | None:
        return len(rows) if len(rows) <= 4 else None


class Batched(Runner):
    """... or the first prompt in lane 0's mixed graph with one more joining it there, and up to 8
    more in one batched graph."""

    def prompt_groups(self, rows: list[int]) -> int | None:
        return None if len(rows) > 10 else 1 + (len(rows) > 2)


def check_and_time(pages: int, page_size: int):
    seen = []

    def timer(runner, b) -> float:
        n_pre = b.num_prefill
        rows = np.diff(b.qo_indptr)
        assert len(rows) == b.batch_size == len(b.page_tables) == len(b.kv_lens)
        assert b.ids.shape[0] == b.pos.shape[0] == b.qo_indptr[-1]
        assert all(rows[n_pre:] == 1) and b.batch_size - n_pre in runner.sizes  # a decode bucket, unpadded
        assert b.ids.shape[1] == CODEBOOKS and b.ids.dtype == np.int64
        # each row at the position after its context; a prompt's rows at 0..n-1
        assert b.pos.tolist() == [*range(b.kv_lens[0])] * n_pre + [k - 1 for k in b.kv_lens[n_pre:]]
        for table, kv in zip(b.page_tables, b.kv_lens, strict=True):
            assert len(table) == -(-kv // page_size) and all(0 < p < pages for p in table)
        decode = b.page_tables[n_pre:]
        assert len({p for t in decode for p in t}) == sum(map(len, decode))  # every row its own pages
        seen.append(b)
        tokens = b.qo_indptr[-1]
        context = sum(b.kv_lens[n_pre:]) - (b.batch_size - n_pre)  # before the step, as the engine counts
        groups = runner.prompt_groups(rows[:n_pre].tolist()) if n_pre else 0
        return A + B * tokens + C * context / 1000 + D * n_pre + E * groups

    return timer, seen


@pytest.mark.parametrize("runner, more", [(Runner(), [(1, 1), (3, 3)]), (Batched(), [(1, 0), (9, 1)])])
def test_each_startup_difference_is_one_part_and_the_fit_recovers_it(runner, more):
    """`more`: (prompts, groups) the steps with more prompts add beside the first one's."""
    pages = 1 + 256 * 64 + 3  # just room for 256 rows of 1024 tokens and a prompt of 48
    timer, seen = check_and_time(pages, 16)
    diffs = step_differences(runner, pages, 16, 1200, CODEBOOKS, timer=timer)
    assert len(diffs) == 7 and len(seen) == 8
    assert [dx[2:] for dx, _ in diffs[-3:]] == [(1.0, 1.0), *((float(k), float(g)) for k, g in more)]
    for (tokens, kcontext, prompts, groups), dt in diffs:
        assert dt == pytest.approx(B * tokens + C * kcontext + D * prompts + E * groups, rel=1e-6)
    cost = StepCost()
    cost.calibrate(diffs)
    rng = np.random.default_rng(0)
    for _ in range(300):  # a steady load: the same step every time, which tells no part apart
        cost.add(300, 300 * 577, 0, A + B * 300 + C * 300 * 0.577 + 1e-5 * rng.standard_normal())
    a, b, c, d, e = cost.coefficients()
    assert a == pytest.approx(A, rel=0.05)
    assert (b, c) == pytest.approx((B, C), rel=0.02)
    if isinstance(runner, Batched):  # prompts in one group tell a prompt from its group
        assert (d, e) == pytest.approx((D, E), rel=0.05)
    else:  # a group each: only their sum shows
        assert d + e == pytest.approx(D + E, rel=0.02)


def test_a_short_context_limit_keeps_the_contexts_apart_and_within_it():
    timer, seen = check_and_time(1 + 256 * 8, 16)
    diffs = step_differences(Runner(), 1 + 256 * 8, 16, 100, CODEBOOKS, timer=timer)
    assert max(max(b.kv_lens) for b in seen) <= 100
    assert len(diffs) == 7


def test_a_small_cache_shortens_the_long_context_so_every_row_keeps_pages_of_its_own():
    timer, seen = check_and_time(1 + 256 * 20, 16)  # 20 pages a row: 320 tokens, not 1024
    diffs = step_differences(Runner(), 1 + 256 * 20, 16, 1200, CODEBOOKS, timer=timer)
    assert max(max(b.kv_lens) for b in seen) <= 19 * 16 and len(diffs) == 7


def test_a_difference_that_is_not_a_positive_time_is_left_out():
    good = [
        ((0.0, 100.0, 0.0), 100 * C),
        ((256.0, 32.0, 0.0), 256 * B + 32 * C),
        ((48.0, 0.0, 1.0), 48 * B + D + E),
    ]
    for bad in (float("nan"), float("inf"), -4e-3, 0.0):
        cost, clean = StepCost(), StepCost()
        cost.calibrate([*good, ((48.0, 0.0, 1.0), bad)])
        clean.calibrate(good)
        for c in (cost, clean):
            for _ in range(300):
                c.add(300, 300 * 577, 0, A + B * 300 + C * 300 * 0.577)
        assert cost.coefficients() == pytest.approx(clean.coefficients(), rel=1e-9)
        assert sum(cost.coefficients()[3:]) == pytest.approx(D + E, rel=0.02)  # a prompt and its group
