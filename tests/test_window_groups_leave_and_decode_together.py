"""Window groups (programs/base.py, `detok_groups`): a codec stream's later windows leave the
gpu_worker in groups of the program's sizes (the last repeating), each counted as sent (its slack,
the listener's audio in hand) when the group leaves, and the codec worker decodes a group as one
merged window and never merges across groups, so a stream's audio does not depend on when its
windows arrive. Chatterbox (tiny config, CPU) decodes its stream in groups of 1, 2 and 4 windows,
the same audio whether the codec worker gets the groups one at a time or all at once."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from codec_worker.streams import rounds
from common.messages import DetokBatch, DetokChunk, Finished, FinishReason, SamplingParams
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.request import Request
from gpu_worker.windows import AudioWindows
from programs import get_spec, load_program_class
from programs.base import pcm16
from programs.blocks import rng
from tests.test_codec_merges_a_streams_waiting_windows import MergingSum
from tests.test_codec_streams import ROWS, played, worker


class GroupedSum(MergingSum):
    """The running-sum codec (exact integer audio) with window groups of 1, 2, then 4."""

    detok_groups = (1, 2, 4)


def request(program, rows: int) -> Request:
    req = Request("r", np.zeros((1, 1), dtype=np.int64), SamplingParams(seed=0), 0.0, rows + 1)
    req.audio = np.arange(rows * program.n_codebooks, dtype=np.int32).reshape(rows, -1)
    return req


def test_groups_leave_when_their_last_window_exists_and_count_as_sent_then() -> None:
    p = GroupedSum()
    now = [100.0]
    windows = AudioWindows(p, "reference", StepClock(p.rows_per_second, 8), now=lambda: now[0])
    req = request(p, 12 * ROWS)
    left = []
    for n in range(1, 12 * ROWS + 1):
        req.n_audio = n
        out: list[DetokChunk] = []
        if n % windows.stride in windows.due:
            windows.after_row(req, out)
        left.append([c.index for c in out])
        now[0] += 0.001
    sends = [ix for ix in left if ix]
    # chunk 0 (the clock's), [1], [2, 3], [4..7], then [8..11] (the last size repeating)
    assert sends == [[0], [1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert req.n_chunks == 12 and not req.grouped
    assert windows.group(9) == (8, 4) and windows.group(13) == (12, 4) and windows.group(2) == (2, 2)
    # audio in hand counts a group when it leaves: 12 windows of audio in all
    assert req.sent_s == pytest.approx(12 * windows._audio_s(ROWS))


def test_a_request_ending_mid_group_sends_the_windows_it_has() -> None:
    p = GroupedSum()
    windows = AudioWindows(p, "reference", StepClock(p.rows_per_second, 8))
    req = request(p, 6 * ROWS)
    out: list[DetokChunk] = []
    for n in range(1, 6 * ROWS + 1):
        req.n_audio = n
        if n % windows.stride in windows.due:
            windows.after_row(req, out)
    assert [c.index for c in out] == [0, 1, 2, 3] and [c.index for c, _ in req.grouped] == [4, 5]
    windows.flush(req, out)
    assert [c.index for c in out] == [0, 1, 2, 3, 4, 5] and {c.group for c in out[4:]} == {4}
    assert not req.grouped


def test_merged_units_stay_within_their_group() -> None:
    def c(i: int, group: int) -> DetokChunk:
        return DetokChunk("a", i, 0, b"", i, group=group)

    # group 2 (2 windows) still waiting when group 4 (4 windows) comes: 2, then 4, never 4 + 2
    chunks = [c(2, 2), c(3, 2), c(4, 4), c(5, 4), c(6, 4), c(7, 4)]
    assert rounds(chunks, list(range(6)), (2, 4)) == [[[0, 1]], [[2, 3, 4, 5]]]
    # a last group of 3 windows: 2 + 1
    assert rounds([c(8, 8), c(9, 8), c(10, 8)], [0, 1, 2], (2, 4)) == [[[0, 1]], [[2]]]


def grouped_chunks(
    rid: str, codes: np.ndarray, rows: int, windows: int, seed: int = 0
) -> list[list[DetokChunk]]:
    """The chunks of a stream of `windows` windows of `rows` rows as its window groups (1, 2, 4)
    leave: [0] (the clock's, no group), [1], [2, 3], [4..7], then 4 at a time."""
    sizes, groups, j = [1, 1, 2], [], 0
    while j < windows:
        m = sizes[len(groups)] if len(groups) < len(sizes) else 4
        group = j if j > 0 else -1
        tokens = [codes[k * rows : (k + 1) * rows].astype("<i4").tobytes() for k in range(windows)]
        groups.append(
            [DetokChunk(rid, k, seed, tokens[k], k, group=group) for k in range(j, min(j + m, windows))]
        )
        j += m
    return groups


def test_the_codec_decodes_each_group_as_one_window() -> None:
    codes = np.random.default_rng(7).integers(0, 5000, 11 * ROWS)
    w = worker(slots=4)
    w.codec = Codec(GroupedSum(), max_batch=4, graphs=False, streams=4)  # --codec-merge 1: groups still merge
    for group in grouped_chunks("r", codes, ROWS, 11):
        w.receive([DetokBatch(chunks=group)], 0.0)
    w.receive([DetokBatch(chunks=[], finished=[Finished("r", FinishReason.STOP)])], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert ends["r"].reason == FinishReason.STOP and len(pcm["r"]) > 0
    # [0] and [1] alone, then 2, 4, and the last group's 3 windows as 2 + 1
    assert w.codec.program.calls == [ROWS, ROWS, 2 * ROWS, 4 * ROWS, 2 * ROWS, ROWS]


@pytest.fixture(scope="module")
def chatterbox(tmp_path_factory):
    """chatterbox-tiny with a flow context of 110 tokens, which holds groups of 2 and 4 windows and
    HiFT's look-back before them (the shipped tiny config's 40 hold none: the program then sends
    every window alone)."""
    tiny = load_program_class("chatterbox-tiny")(get_spec("chatterbox-tiny"), load_format="dummy")
    assert tiny.detok_groups == () and tiny.codec_merge == ()
    cfg = {**tiny.read_config("codec_config"), "flow_context": 110}
    path = tmp_path_factory.mktemp("chatterbox") / "s3gen.json"
    path.write_text(json.dumps(cfg))
    spec = {**get_spec("chatterbox-tiny"), "codec_config": str(path)}
    p = load_program_class("chatterbox-tiny")(spec, load_format="dummy")
    p.load_codec()
    return p


def test_chatterbox_audio_is_the_same_however_its_groups_arrive(chatterbox) -> None:
    assert chatterbox.detok_groups == (1, 2, 4)
    r = chatterbox.detok_interval
    codes = np.random.default_rng(2).integers(0, 6561, 9 * r)
    groups = grouped_chunks("s", codes, r, 9, seed=5)
    pcm = {}
    for label, batches in (("one by one", [[g] for g in groups]), ("all at once", [groups])):
        codec = Codec(chatterbox, max_batch=4, graphs=False, streams=3)
        audio = []
        for batch in batches:
            for a in codec.decode([c for g in batch for c in g]):
                audio.append(np.frombuffer(a.pcm, dtype="<i2"))
        pcm[label] = np.concatenate(audio)
    assert np.array_equal(pcm["one by one"], pcm["all at once"])
    # and each group decoded as one window of its tokens: S3Gen's stream call by call
    s3 = chatterbox.codec
    s3.init_streams(2)
    slot = torch.tensor([0])
    key = rng.mix_keys(torch.tensor([5]), torch.tensor([0]))  # the stream's: its first window's
    want, start = [], 0
    for m in (1, 1, 2, 4, 1):
        ids = torch.from_numpy(codes[start * r : (start + m) * r].astype(np.int64))[None]
        fresh = torch.tensor([start == 0])
        with torch.no_grad():
            want.append(s3.decode_stream(ids, key, slot, fresh)[0].float().clamp(-1, 1))
        start += m
    want_pcm = pcm16(torch.cat(want)).numpy()
    assert np.abs(pcm["one by one"].astype(np.int32) - want_pcm.astype(np.int32)).max() <= 1


def test_groups_need_codec_streams_and_merge_sizes() -> None:
    class NoStreams(GroupedSum):
        codec_streams = False

    class BadSize(GroupedSum):
        detok_groups = (1, 3)

    for cls in (NoStreams, BadSize):
        with pytest.raises(ValueError, match="window groups"):
            cls()


def test_an_engine_and_the_codec_serve_a_chatterbox_stream_in_groups(chatterbox) -> None:
    """The gpu_worker's engine (T3, tiny random weights) sends a stream's windows in groups and the
    codec worker's decodes give S3Gen's stream decoded group by group (the last group shorter)."""
    from common.config import GpuWorkerSettings
    from gpu_worker.engine import Engine
    from tests.test_chatterbox_parity import make_prompt

    chatterbox.load_lm()
    chatterbox.load_prompts()
    r = chatterbox.detok_interval
    eng = Engine(chatterbox, GpuWorkerSettings(max_batch_size=2, max_context=500))
    eng.add(
        make_prompt(
            chatterbox, "x", "Hello there.", 7 * r + 10, {}, temperature=0.8, seed=3, min_tokens=7 * r + 5
        )
    )
    chunks = [c for b in eng.run_until_idle() for c in b.chunks]
    n = len(chunks)
    assert n >= 6 and [c.index for c in chunks] == list(range(n))
    firsts = [-1, 1, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8]
    assert [c.group for c in chunks] == firsts[:n]  # the last group cut at the request's end
    codec = Codec(chatterbox, max_batch=4, graphs=False, streams=3)
    pcm = np.concatenate([np.frombuffer(a.pcm, dtype="<i2") for a in codec.decode(chunks)])
    tokens = np.concatenate([np.frombuffer(c.tokens, dtype="<i4") for c in chunks]).astype(np.int64)
    s3 = chatterbox.codec
    s3.init_streams(2)
    key = rng.mix_keys(torch.tensor([3]), torch.tensor([0]))
    want, start = [], 0
    sizes = [1, 1, 2]  # then the groups of 4, the last one cut into merges of 4, 2, 1
    left = n - 4
    while left > 0:
        group = min(4, left)
        sizes += [m for m in (4, 2, 1) if group & m]
        left -= group
    for m in sizes:
        ids = torch.from_numpy(tokens[start * r : (start + m) * r])[None]
        with torch.no_grad():
            out = s3.decode_stream(ids, key, torch.tensor([0]), torch.tensor([start == 0]))
        want.append(out[0].float().clamp(-1, 1))
        start += m
    assert np.abs(pcm.astype(np.int32) - pcm16(torch.cat(want)).numpy().astype(np.int32)).max() <= 1


def test_an_aborted_stream_counts_the_windows_it_sent_not_those_its_group_held(chatterbox) -> None:
    """A request aborted while windows of its group wait for the group's last one: its end
    (`Finished.n_chunks`, what the taps report) counts the windows that left, which the held ones
    never do."""
    from common.config import GpuWorkerSettings
    from gpu_worker.engine import Engine
    from tests.test_chatterbox_parity import make_prompt

    chatterbox.load_lm()
    chatterbox.load_prompts()
    r = chatterbox.detok_interval
    eng = Engine(chatterbox, GpuWorkerSettings(max_batch_size=2, max_context=500))
    eng.add(
        make_prompt(chatterbox, "x", "Hello there.", 9 * r, {}, temperature=0.8, seed=3, min_tokens=9 * r)
    )
    sent, ends = [], []
    while not eng.scheduler.running or not eng.scheduler.running["x"].grouped:
        batch = eng.step()
        sent += batch.chunks if batch else []
    held = len(eng.scheduler.running["x"].grouped)
    eng.abort("x")
    for batch in eng.run_until_idle():
        sent += batch.chunks
        ends += batch.finished
    assert held and [e.rid for e in ends] == ["x"] and ends[0].reason == FinishReason.ABORT
    assert ends[0].n_chunks == len(sent) == [c.index for c in sent][-1] + 1


def test_admission_paces_the_lm_as_fast_as_groups_need(chatterbox) -> None:
    """Window 4 of groups (1, 2, 4) leaves with window 7: the LM must make 7 windows of rows while 4
    play, 1.75 times real time; admission's step budget shrinks by that much."""
    from common.config import GpuWorkerSettings
    from gpu_worker.scheduler.scheduler import step_clock
    from gpu_worker.windows import group_pace

    assert group_pace(GroupedSum()) == pytest.approx(7 / 4)
    assert group_pace(chatterbox) == pytest.approx(7 / 4)
    plain = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    assert group_pace(plain) == 1.0
    limits = GpuWorkerSettings()
    assert step_clock(chatterbox, limits).headroom == pytest.approx(limits.realtime_headroom / 1.75)
    assert step_clock(plain, limits).headroom == limits.realtime_headroom


def test_a_streams_lead_counts_the_rows_its_group_still_needs() -> None:
    p = GroupedSum()
    windows = AudioWindows(p, "reference", StepClock(p.rows_per_second, 8))
    req = request(p, 12 * ROWS)
    out: list[DetokChunk] = []
    for n in range(1, 5 * ROWS + 1):  # windows 0..4: [0], [1], [2, 3] sent, 4 waits for 5..7
        req.n_audio = n
        if n % windows.stride in windows.due:
            windows.after_row(req, out)
    assert [c.index for c, _ in req.grouped] == [4]
    assert windows.rows_to_group_end(req) == 3 * ROWS  # windows 5, 6, 7
    req.grouped.clear()
    req.n_chunks = 8  # the next group opens at window 8: all of its 4 windows to make
    req.n_audio = 8 * ROWS
    assert windows.rows_to_group_end(req) == 4 * ROWS


def test_groups_are_refused_with_appended_text(monkeypatch) -> None:
    p = GroupedSum()
    monkeypatch.setattr(p, "appends_text", True, raising=False)
    with pytest.raises(ValueError, match="appended text"):
        AudioWindows(p, "reference", StepClock(p.rows_per_second, 8))
