"""A codec pass is bounded in GPU time (`--codec-pass-ms`): at the cost per row measured on earlier
passes, the windows past the budget stay gathered, due at once, and go in the next pass behind the
first chunks that came meanwhile; a request's windows leave in order and its end after its last
window; every pass takes at least one full call of rows, and nothing is held back before a cost
is measured."""

from __future__ import annotations

from codec_worker.gather import Gather
from common.messages import DetokBatch, DetokChunk, Finished, FinishReason

ROW = 4 * 2  # a row of two codebooks on the wire


def window(rid: str, index: int, rows: int, slack_ms: float = 500.0) -> DetokChunk:
    return DetokChunk(rid, index, 1, b"\0" * (ROW * rows), index, slack_ms=slack_ms)


def gather(pass_s: float = 0.010, min_rows: int = 4) -> Gather:
    return Gather(max_wait_s=0.030, full_batch=64, pass_s=pass_s, row_bytes=ROW, min_rows=min_rows)


def test_nothing_is_held_back_before_a_pass_is_measured():
    g = gather()
    g.add(DetokBatch([window(f"r{i}", 1, 8) for i in range(10)], []), arrived=0.0)
    urgent, rest, _ = g.take()
    assert not urgent and len(rest) == 10 and not g.chunks


def test_a_pass_takes_what_its_budget_holds_and_the_rest_is_due_next():
    g = gather(pass_s=0.010)
    g.decoded(0.020, rows=40)  # 0.5 ms a row: a 10 ms pass holds 20 rows
    assert g.row_s == 0.0005
    chunks = [window(f"r{i}", 1, 8) for i in range(5)] + [window("r0", 2, 8)]
    g.add(
        DetokBatch(
            chunks, [Finished("r0", FinishReason.STOP, n_chunks=3), Finished("r4", FinishReason.STOP)]
        ),
        arrived=1.0,
    )
    urgent, rest, ends = g.take()
    assert not urgent and [(c.rid, c.index) for c in rest] == [("r0", 1), ("r1", 1)]  # 16 rows of 20
    assert ends == []  # r0 and r4 still have windows waiting
    assert [(c.rid, c.index) for c in g.chunks] == [("r2", 1), ("r3", 1), ("r4", 1), ("r0", 2)]
    assert g.due(1.0)  # what a pass left is due at once

    # A first chunk that came meanwhile goes first; it counts against the budget.
    g.add(DetokBatch([window("new", 0, 4, slack_ms=0.0)], []), arrived=1.01)
    urgent, rest, ends = g.take()
    assert [(c.rid, c.index) for c in urgent] == [("new", 0)]
    assert [(c.rid, c.index) for c in rest] == [("r2", 1), ("r3", 1)]
    assert ends == []
    urgent, rest, ends = g.take()
    assert [(c.rid, c.index) for c in rest] == [("r4", 1), ("r0", 2)]
    assert sorted(f.rid for f in ends) == ["r0", "r4"]  # with their last windows
    assert not g.chunks and not g.due(1.02)


def test_every_pass_takes_at_least_a_full_call_of_rows():
    g = gather(pass_s=0.001, min_rows=16)
    g.decoded(0.100, rows=16)  # 6.25 ms a row: the budget is under one row
    g.add(DetokBatch([window(f"r{i}", 1, 8) for i in range(4)], []), arrived=0.0)
    _, rest, _ = g.take()
    assert len(rest) == 2  # min_rows


def test_small_passes_do_not_move_the_measured_cost():
    g = gather(min_rows=16)
    g.decoded(0.010, rows=32)
    g.decoded(0.050, rows=2)  # a lone first chunk's pass: mostly fixed cost
    assert g.row_s == 0.010 / 32


def test_no_bound_keeps_every_window_in_one_pass():
    g = gather(pass_s=0.0)
    g.decoded(1.0, rows=16)
    g.add(DetokBatch([window(f"r{i}", 1, 8) for i in range(10)], []), arrived=0.0)
    assert len(g.take()[1]) == 10
