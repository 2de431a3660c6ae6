"""One codec pass: the urgent group (first chunks) is decoded and sent before the gathered rest is
decoded, on the eager path too (its decodes run when read); where the rest's launch would first
wait for the urgent group's (a window kind of both), the urgent group is sent before the rest is
launched; a window that cannot be decoded ends its own request with an error, and the other
windows and ends held with it go on unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from codec_worker.gather import Gather
from codec_worker.worker import Codec, CodecWorker
from common.messages import AudioChunks, DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_codec()
    return p


def window(rid: str, index: int, rows: int = 28) -> DetokChunk:
    codes = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(index))
    tokens = (128266 + 4096 * (torch.arange(rows) % 7) + codes).int().numpy().astype("<i4")
    return DetokChunk(rid, index, 5, tokens.tobytes(), index)


class Recorder:
    def __init__(self, log: list) -> None:
        self.log = log

    def send(self, msg: AudioChunks) -> None:
        self.log.append(("send", [c.rid for c in msg.chunks], [(f.rid, f.reason) for f in msg.finished]))


class Status:
    def set_load(self, *args) -> None:
        pass


def worker(program, log: list) -> CodecWorker:
    w = CodecWorker.__new__(CodecWorker)  # no sockets: the pass logic alone
    w.codec = Codec(program, max_batch=8, graphs=False)
    decode = w.codec._decode_eager

    def logged(tokens, keys, tail=0):
        log.append(("decode", len(tokens)))
        return decode(tokens, keys, tail)

    w.codec._decode_eager = logged
    w.gather, w.to_gateway, w.status = Gather(0.03, 8), Recorder(log), Status()
    w.counters = {"codec_calls_total": 0, "codec_windows_total": 0, "codec_busy_seconds_total": 0.0}
    return w


def test_the_urgent_group_is_sent_before_the_rest_is_decoded(program):
    log: list = []
    w = worker(program, log)
    urgent = [window("new", 0)]
    rest = [window(f"s{i}", 3) for i in range(5)]
    w._decode_and_send([(urgent, []), (rest, [Finished("s0", FinishReason.STOP)])])
    assert log == [
        ("decode", 1),
        ("send", ["new"], []),
        ("decode", 5),
        ("send", [f"s{i}" for i in range(5)], [("s0", FinishReason.STOP)]),
    ]
    assert w.counters["codec_calls_total"] == 1 and w.counters["codec_windows_total"] == 6


class Graphs:
    """What `Codec.would_wait` reads of a kind's DetokGraphs: its launch not yet read out."""

    def __init__(self, pending: object | None = None) -> None:
        self.pending = pending


@pytest.mark.parametrize("waits", [False, True], ids=["launch-free", "launch-would-wait"])
def test_a_group_whose_launch_would_wait_is_launched_after_the_groups_before_it_are_sent(program, waits):
    log: list = []
    w = worker(program, log)
    launch = w.codec.launch
    w.codec.launch = lambda chunks: log.append(("launch", len(chunks))) or launch(chunks)
    w.codec.would_wait = lambda chunks: waits
    urgent, rest = [window("new", 0)], [window(f"s{i}", 3) for i in range(4)]
    w._decode_and_send([(urgent, []), (rest, [Finished("s0", FinishReason.STOP)])])
    sends = [("send", ["new"], []), ("send", [f"s{i}" for i in range(4)], [("s0", FinishReason.STOP)])]
    if waits:  # the urgent group decoded and sent before the rest is launched at all
        assert log == [("launch", 1), ("decode", 1), sends[0], ("launch", 4), ("decode", 4), sends[1]]
    else:  # both launched, then each read and sent in turn
        assert log == [("launch", 1), ("launch", 4), ("decode", 1), sends[0], ("decode", 4), sends[1]]
    assert w.counters["codec_calls_total"] == 1 and w.counters["codec_windows_total"] == 5


def test_a_launch_would_wait_for_a_kind_in_flight(program):
    codec = Codec(program, max_batch=8, graphs=False)
    rows = program.detok_lead[0]
    regular, lead = [window(f"r{i}", 3) for i in range(8)], window("new", 0, rows=rows)
    assert not codec.would_wait(regular + [lead])  # eager: every decode runs when read
    codec.graphs = {(28, 0): Graphs(), (rows, 0): Graphs()}  # as on a GPU: graphs per kind
    assert not codec.would_wait(regular + [lead])  # their graphs free
    codec.graphs[28, 0].pending = object()  # a regular launch not yet read out
    assert codec.would_wait(regular[:1]) and codec.would_wait([lead, *regular[:1]])
    assert not codec.would_wait([lead])


def test_a_failed_group_ends_only_its_own_requests(program):
    log: list = []
    w = worker(program, log)
    urgent = [window("new", 0)]
    bad = [window("s1", 3), window("odd", 4, rows=5)]  # 5 rows: no such window kind
    held = [Finished("new", FinishReason.STOP), Finished("s1", FinishReason.STOP)]
    w._decode_and_send([(urgent, []), (bad, held)])
    sends = [entry for entry in log if entry[0] == "send"]
    # The urgent audio first, then the other group: s1's audio, the failure of "odd" alone, and the
    # ends held with it.
    assert sends == [
        ("send", ["new"], []),
        (
            "send",
            ["s1"],
            [("odd", FinishReason.ERROR), ("new", FinishReason.STOP), ("s1", FinishReason.STOP)],
        ),
    ]


def test_a_slow_pass_is_logged_with_its_windows_by_kind(program, caplog, monkeypatch):
    # the second pass within the log's interval however slowly this host decodes the first
    monkeypatch.setattr("codec_worker.worker.SLOW_LOG_S", 3600.0)
    log: list = []
    w = worker(program, log)
    w.slow_pass_s = 0.0  # every pass is slow (on a GPU: past SLOW_PASS_S)
    w._slow_log_at = -math.inf  # nothing logged yet
    with caplog.at_level("WARNING", logger="codec_worker.worker"):
        w._decode_and_send([([window("new", 0)], []), ([window(f"s{i}", 3) for i in range(3)], [])])
        w._decode_and_send([([window("t", 1)], [])])  # within SLOW_LOG_S of the first: counted, not logged
    lines = [r.getMessage() for r in caplog.records if "slow pass" in r.getMessage()]
    assert len(lines) == 1 and "{(28, 0): 4}" in lines[0] and "1 slow passes so far" in lines[0], lines
    assert w.slow_passes == 2
