"""`--decode-row-tile N` (programs.blocks.fp8.row_tiles): the decode graphs run every backbone GEMM
and the head's in tiles of exactly N rows, so a decode row's bits do not depend on its bucket, whatever kernel a
GEMM library picks by row count. Checked with the graph runner on the CPU stand-ins for FlashInfer
and CUDA graphs (orpheus-tiny, float32): every GEMM a decode graph runs holds N rows; mixed graphs
are off; and a sampled request's tokens are the same alone and among staggered others, as they are
through the eager runner. (On the CPU, MKL rounds a row differently at 1, 2-3 and 4+ rows.)"""

from __future__ import annotations

import numpy as np
import pytest

from common.messages import Prompt, SamplingParams
from programs.blocks import fp8
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

TILE = 16
LIMITS = dict(max_batch_size=8, max_context=200, decode_row_tile=TILE, first_chunk="fastest")


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("orpheus-tiny", lm_head="audio")


def prompt(rid: str, seed: int, temperature: float = 0.8) -> Prompt:
    rows = np.array([128259, 300 + seed, 301, 128009, 128260, 128261, 128257], dtype="<i4")
    sp = SamplingParams(max_tokens=70, constrained=True, seed=seed, temperature=temperature)
    return Prompt(rid, rows.tobytes(), len(rows), sp)


def test_decode_graphs_run_tiles_and_a_request_keeps_its_tokens(program, graph_runner_cls, monkeypatch):  # noqa: F811
    rows_seen, weights_seen = [], []
    real = fp8._linear

    def spy(x, weight, bias):
        if fp8._row_tile:
            rows_seen.append(x.shape[0])
            weights_seen.append(weight)
        return real(x, weight, bias)

    monkeypatch.setattr(fp8, "_linear", spy)
    eng = graph_engine(program, graph_runner_cls, LIMITS)
    runner = eng.runner.forward_runner
    assert runner.row_tile == TILE and not runner.mixed  # decode rows run in decode graphs only
    target = prompt("x", 11)
    alone = staggered(eng, [target])["x"]
    crowd = staggered(eng, [prompt("a", 1), target, *(prompt(f"o{i}", 20 + i) for i in range(5))])["x"]
    assert crowd == alone and len(alone[0]) > 40
    assert rows_seen and set(rows_seen) == {TILE}
    assert any(w is program._head_weight for w in weights_seen)  # the audio head's GEMMs too
