"""A codec stream's waiting windows decode as one merged window (programs/base.py, `codec_merge`;
codec_worker/streams.py `rounds`): with the running-sum codec of test_codec_streams (exact integer
audio), merged decodes give each chunk the audio of its windows decoded one by one and of the whole
stream, in fewer decode calls; a window's own validity survives the merge; runs stop at a gap in a
request's indices and at windows that may not merge. The real programs that merge (Qwen3-TTS, CSM,
Higgs Audio v2, tiny configs on CPU) give the same PCM merged and window by window, within one
least significant bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from codec_worker.streams import rounds
from common.messages import DetokBatch, DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class
from tests.test_codec_streams import ROWS, RunningSumProgram, chunk, expected, played, worker


class MergingSum(RunningSumProgram):
    """The running-sum codec, merging up to 4 windows; it records each call's row count."""

    codec_merge = (2, 4)

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.calls: list[int] = []

    def detokenize(self, tokens, keys, tail_rows=0, streams=None):
        self.calls.append(tokens.shape[1])
        return super().detokenize(tokens, keys, tail_rows, streams)


class SilentFirstWindows(MergingSum):
    """As MergingSum, each window's own validity: a stream's first two windows yield no audio."""

    def init_codec_streams(self, n_slots: int) -> None:
        super().init_codec_streams(n_slots)
        self.windows = torch.zeros(n_slots, dtype=torch.int64)

    def detokenize(self, tokens, keys, tail_rows=0, streams=None):
        m = tokens.shape[1] // ROWS
        done = torch.where(streams.fresh, 0, self.windows[streams.slot])
        self.windows[streams.slot] = done + m
        audio, _ = super().detokenize(tokens, keys, tail_rows, streams)
        valid = done[:, None] + torch.arange(m) >= 2  # [Bd, m]
        return audio, (valid[:, 0] if m == 1 else valid)


def merging_worker(program_cls, merge: int, slots: int = 6):
    w = worker(slots=slots)
    w.codec = Codec(program_cls(), max_batch=4, graphs=False, streams=slots, merge=merge)
    return w


def test_a_streams_waiting_windows_decode_merged_as_they_would_alone() -> None:
    codes = np.random.default_rng(3).integers(0, 5000, ROWS * 7)
    w = merging_worker(MergingSum, merge=8)
    w.receive([DetokBatch(chunks=[chunk("r", j, codes) for j in range(7)])], 0.0)
    w.decode_pass()
    w.receive([DetokBatch(chunks=[], finished=[Finished("r", FinishReason.STOP)])], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert pcm == {"r": expected(w, codes)} and ends["r"].reason == FinishReason.STOP
    # 7 windows waiting together: three decodes (4 + 2 + 1 windows), not 7 rounds
    assert sorted(w.codec.program.calls) == [ROWS, 2 * ROWS, 4 * ROWS]
    assert w.counters["codec_windows_total"] == 7


def test_merge_one_decodes_each_window_alone() -> None:
    codes = np.random.default_rng(4).integers(0, 5000, ROWS * 5)
    w = merging_worker(MergingSum, merge=1)
    w.receive([DetokBatch(chunks=[chunk("r", j, codes) for j in range(5)])], 0.0)
    w.decode_pass()
    assert w.codec.program.calls == [ROWS] * 5 and played(w)[0] == {"r": expected(w, codes)}


def test_interleaved_streams_merged_at_random_equal_their_whole_decode() -> None:
    rng = random.Random(1)
    w = merging_worker(MergingSum, merge=4, slots=8)
    codes = {
        f"r{i}": np.random.default_rng(10 + i).integers(0, 5000, ROWS * rng.randint(1, 12)) for i in range(9)
    }
    todo = {rid: [chunk(rid, j, c) for j in range(len(c) // ROWS)] for rid, c in codes.items()}
    while todo:
        batch = DetokBatch(chunks=[])
        for rid in rng.sample(sorted(todo), k=rng.randint(1, len(todo))):
            for _ in range(rng.randint(1, 5)):  # several windows of one stream waiting at times
                if todo[rid]:
                    batch.chunks.append(todo[rid].pop(0))
            if not todo[rid]:
                batch.finished.append(Finished(rid, FinishReason.STOP))
                del todo[rid]
        w.receive([batch], 0.0)
        if rng.random() < 0.3:
            w.decode_pass()
    w.decode_pass()
    pcm, ends = played(w)
    assert set(ends) == set(codes)
    assert all(pcm[rid] == expected(w, c) for rid, c in codes.items())
    assert max(w.codec.program.calls) > ROWS, "some windows merged"
    assert sorted(w.codec.slots.free) == list(range(8))


def test_a_merged_window_keeps_each_windows_validity() -> None:
    codes = np.random.default_rng(5).integers(0, 5000, ROWS * 6)
    got = {}
    for merge in (1, 8):
        w = merging_worker(SilentFirstWindows, merge=merge)
        w.receive([DetokBatch(chunks=[chunk("r", j, codes) for j in range(6)])], 0.0)
        w.decode_pass()
        by_index = {a.index: a.pcm for m in w.to_gateway.sent for a in m.chunks}
        got[merge] = [by_index[j] for j in range(6)]
    assert got[1] == got[8] and got[8][:2] == [b"", b""] and all(got[8][2:])


def test_merged_units_run_over_consecutive_mergeable_windows_of_a_request() -> None:
    c = [DetokChunk("a", i, 0, b"", i) for i in (1, 2, 3, 4, 5, 7, 8)] + [DetokChunk("b", 0, 0, b"", 0)]
    where = list(range(len(c)))
    # a: 1..5 then a gap before 7, 8; b alone; largest merge first; a unit a round per request
    assert rounds(c, where, (2, 4)) == [[[0, 1, 2, 3], [7]], [[4]], [[5, 6]]]
    assert rounds(c, where, ()) == [[[0], [7]]] + [[[i]] for i in range(1, 6 + 1)]
    # a window that may not merge (another kind) breaks the run
    assert rounds(c, where, (2, 4), lambda i: i != 1) == [[[0], [7]], [[1]], [[2, 3]], [[4]], [[5, 6]]]


N = 40  # windows: past Higgs's delay pattern and look-ahead (19 rows without audio)


@pytest.mark.parametrize("name", ["qwen3-tts-tiny", "csm-tiny", "higgs-tts-tiny"])
def test_merging_programs_give_the_window_by_window_audio(name: str) -> None:
    program = load_program_class(name)(get_spec(name), load_format="dummy")
    program.load_codec()
    assert program.codec_streams and program.codec_merge
    c = program.n_codebooks
    rows = np.random.default_rng(7).integers(0, 64, (N * program.detok_interval, c))
    audio = {}
    for merge in (1, 8):
        codec = Codec(program, max_batch=8, graphs=False, streams=2, merge=merge)
        chunks = [
            DetokChunk("r", j, 0, rows[j * program.detok_interval : (j + 1) * program.detok_interval].astype("<i4").tobytes(), j)
            for j in range(N)
        ]  # fmt: skip
        out = {a.index: np.frombuffer(a.pcm, "<i2").astype(np.int32) for a in codec.decode(chunks[:1])}
        out |= {a.index: np.frombuffer(a.pcm, "<i2").astype(np.int32) for a in codec.decode(chunks[1:])}
        audio[merge] = out
    assert sorted(audio[8]) == sorted(audio[1]) == list(range(N))
    for j in range(N):
        a, b = audio[1][j], audio[8][j]
        assert len(a) == len(b) and (len(a) == 0 or np.abs(a - b).max() <= 1), j
    assert sum(len(a) for a in audio[8].values()) > 0
