"""Higgs Audio v2's repetition-aware sampling (programs/higgs_tts/program.py; the published
generation_config.json's `ras_win_len` 7, `ras_win_max_num_repeat` 2) in its parts: a codebook's id
that the request's last 7 audio rows hold twice or more is redrawn (stream bos and eos and the
program's markers not counted); each slot counts its own rows; a cloned voice's last clip rows open
the window (`ras_window`, from `preprocess`, vetted by `check_prompt`), oldest first to be
overwritten; the redraw is the runtime's untempered draw, keyed by request, codebook and row. The
parity tests check whole generations against transformers' with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.runner.sampler import SamplingRows, depth_sampler
from programs import get_spec, load_program_class
from programs.base import Voice
from programs.higgs_tts import spec as h
from programs.higgs_tts.program import clip_rows

REDRAWN = 777


class Redraws:
    """A sampler whose redraws are all REDRAWN."""

    def untempered(self, logits: torch.Tensor, salt: int) -> torch.Tensor:
        assert salt == h.RAS_SALT
        return torch.full(logits.shape[:2], REDRAWN, dtype=torch.int64)


@pytest.fixture()
def program():
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy", device="cpu")
    p.init_state(3)
    return p


def test_an_id_the_window_holds_twice_is_redrawn_and_bos_eos_never_count(program):
    window = 100 + np.arange(h.RAS_WINDOW * h.N_CODEBOOKS, dtype=np.int32).reshape(h.RAS_WINDOW, -1)
    window[:, 2] = [5, 9, 5, 1, 2, 3, 4]  # 5 twice
    window[:, 3] = [6, 9, 8, 1, 2, 3, 4]  # 6 once
    window[:, 4] = h.STREAM_BOS  # bos every row
    window[:, 5] = [h.STREAM_EOS] * 6 + [7]
    program.admit(1, {"ras_window": window})
    program.admit(2, {})
    row = torch.tensor([[100, 0, 5, 6, h.STREAM_BOS, h.STREAM_EOS, 0, 0]] * 2)  # 100 once
    logits = torch.zeros(2, h.N_CODEBOOKS, h.CODEBOOK_IDS)
    out = program._repetition_aware(row, logits, Redraws(), torch.tensor([1, 2]))
    assert out[0].tolist() == [100, 0, REDRAWN, 6, h.STREAM_BOS, h.STREAM_EOS, 0, 0]
    assert out[1].tolist() == row[1].tolist(), "an empty window redraws nothing"


def test_generated_rows_overwrite_the_oldest_clip_rows_first(program):
    window = np.arange(3 * h.N_CODEBOOKS, dtype=np.int32).reshape(3, h.N_CODEBOOKS)  # 3 clip rows
    program.admit(0, {"ras_window": window})
    ring = program._recent[0]
    assert (ring[: h.RAS_WINDOW - 3] == -1).all() and torch.equal(ring[-3:], torch.from_numpy(window).long())
    # generated row t lands at t % 7: the clip's rows stay until rows 4, 5 and 6 replace them
    for t in range(h.RAS_WINDOW):
        program._recent[0, t % h.RAS_WINDOW] = 100 + t
        left = [r for r in window.tolist() if r in program._recent[0].tolist()]
        assert len(left) == min(3, h.RAS_WINDOW - 1 - t)


def test_a_cloned_prompt_carries_its_clips_last_rows_and_bad_windows_are_refused(program):
    codes = np.random.default_rng(0).integers(0, 1024, (20, h.N_CODEBOOKS)).astype(np.int32)
    prompt = program.preprocess("Hello there.", {}, Voice({"codes": codes}, "A clip."))
    np.testing.assert_array_equal(
        prompt.state["ras_window"], clip_rows(codes)[-h.RAS_WINDOW :] - h.PROMPT_AUDIO
    )
    assert program.check_prompt(prompt.rows, prompt.state) == ""
    assert program.preprocess("Hello there.", {}).state == {}
    for bad in (
        np.zeros((h.RAS_WINDOW + 1, h.N_CODEBOOKS), np.int32),
        np.zeros((2, 3), np.int32),
        np.full((2, h.N_CODEBOOKS), h.CODEBOOK_IDS, np.int32),
    ):
        assert "ras_window" in program.check_prompt(prompt.rows, {"ras_window": bad})
    assert "at most the state" in program.check_prompt(prompt.rows, {"other": codes})


def test_the_redraw_is_keyed_by_request_codebook_and_row_whatever_the_batch():
    """`untempered`: temperature 1 and no top-k/p even for a greedy request; entry k of request b
    draws with (seed_b, salt + k) at its counter, so a request's redraws are the same alone and in
    a batch, and differ across codebooks, seeds and rows."""

    def rows(seeds: list[int], counters: list[int]) -> SamplingRows:
        n = len(seeds)
        return SamplingRows(
            temperature=torch.zeros(n),  # greedy requests
            top_k=torch.ones(n, dtype=torch.int64),  # top-1: the request's own settings would fix the id
            top_p=torch.ones(n),
            min_p=torch.zeros(n),
            rep_penalty=torch.ones(n),
            seed=torch.tensor(seeds),
            counter=torch.tensor(counters),
            history=None,
            block_stop=torch.zeros(n, dtype=torch.bool),
        )

    logits = torch.zeros(3, h.N_CODEBOOKS, h.CODEBOOK_IDS)  # uniform: any id may come
    batch = depth_sampler(rows([1, 2, 1], [5, 5, 6])).untempered(logits, h.RAS_SALT)
    alone = depth_sampler(rows([1], [5])).untempered(logits[:1], h.RAS_SALT)
    assert torch.equal(batch[:1], alone)
    assert len(set(batch[0].tolist())) > 4, "codebooks draw apart"
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[0], batch[2]), "seeds and rows"


def test_a_depth_graphs_padding_rows_write_only_the_scratch_slots_window():
    """The depth step in graphs (gpu_worker/runner/depth_graphs.py, replayed here by a stand-in that
    reruns the captured call): a bucket's padding entries sit on the scratch slot, so the rows they
    write never reach a live request's window, also after a larger batch filled the bucket."""
    from unittest import mock

    import gpu_worker.runner.depth_graphs as dg
    from programs.base import Rows

    class Replay:
        def __init__(self, step, out) -> None:
            self.step, self.out = step, out

        def replay(self) -> None:
            self.out.copy_(self.step())

    def capture(step, pool, stream=None):
        out = step()
        return Replay(step, out), out

    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy", device="cpu")
    p.load_lm()
    scratch = 8
    p.init_state(scratch + 1)
    with mock.patch.object(dg, "capture", capture), mock.patch("torch.cuda.graph_pool_handle", lambda: None):
        graphs = dg.DepthGraphs(p, [4, 8], scratch_slot=scratch)

    def step(slots: list[int]) -> None:
        n = len(slots)
        rows = SamplingRows(
            torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n), torch.ones(n),
            torch.arange(n), torch.full((n,), 3), None, torch.zeros(n, dtype=torch.bool),
        )  # fmt: skip
        where = Rows(
            torch.tensor(slots), torch.full((n,), 3), torch.zeros(n, h.N_CODEBOOKS, dtype=torch.int64)
        )
        with torch.inference_mode():
            graphs.run(torch.randn(n, p.hidden_size, dtype=p.dtype), torch.arange(n), rows, where)

    for s in range(scratch):
        p.admit(s, {})
    step([0, 1, 2, 3, 4, 5])  # bucket 8: two padding entries
    filled = [int((p._recent[s] >= 0).all(-1).sum()) for s in range(6)]
    assert filled == [1] * 6, "each live slot holds its own row alone"
    first = p._recent.clone()
    step([5, 6, 7])  # bucket 4: one padding entry, where slot 3 sat in the larger batch
    written = {s for s in range(scratch + 1) if (p._recent[s] >= 0).any()}
    assert written == {0, 1, 2, 3, 4, 5, 6, 7, scratch}
    assert torch.equal(p._recent[:5], first[:5]), "slots 0-4 (not in the second step) keep their rows"
