"""`--codec-first-lane`: while a codec pass decodes on the device, the worker takes what arrives,
and the first chunks among it are decoded at once in the codec's first lane (on a GPU, graphs of
the lead kinds of their own on a high-priority stream) and sent as soon as they are done, before
the pass's own audio; an end that arrives meanwhile waits for the pass's audio (the request's last
windows may be in it). The pass logic is checked with stand-ins for the device's progress and the
inbox; the lane's graphs on a GPU in tests/gpu/test_gpu_codec_first_lane.py."""

from __future__ import annotations

import time
import types

import pytest
import torch

from codec_worker.gather import Gather
from codec_worker.worker import Codec, CodecWorker
from common.config import CodecSettings
from common.messages import DetokBatch, DetokChunk, Finished, FinishReason
from common.options import parse_role
from gpu_worker.windows import LANE_ROOM
from gpu_worker.worker import codec_lane
from programs import get_spec, load_program_class
from tests.test_codec_pass_sends_urgent_first_and_fails_only_its_own import Recorder, Status


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_codec()
    return p


def window(rid: str, index: int, rows: int = 28, slack_ms: float = 0.0, tail: int = 0) -> DetokChunk:
    codes = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(index))
    tokens = (128266 + 4096 * (torch.arange(rows) % 7) + codes).int().numpy().astype("<i4")
    return DetokChunk(rid, index, 5, tokens.tobytes(), index, slack_ms=slack_ms, tail_rows=tail)


class Inbox:
    """What the worker drains: each drain the next list of messages (then none)."""

    def __init__(self, batches: list[list]) -> None:
        self.batches = batches

    def drain(self, timeout_ms: int = 0) -> list:
        return self.batches.pop(0) if self.batches else []


def worker(program, log: list, arrivals: list[list]) -> CodecWorker:
    w = CodecWorker.__new__(CodecWorker)  # no sockets: the pass logic alone
    w.codec = Codec(program, max_batch=8, graphs=False, tails=True)
    # as on a GPU with --codec-first-lane: graphs of the lead kinds and the second chunks' tail
    # kinds (stand-ins: the decode is eager)
    lead = {(r, 0): None for r in program.detok_lead} | dict.fromkeys(w.codec.second_kinds())
    w.codec.lane = types.SimpleNamespace(graphs=lead, limits=dict.fromkeys(lead, 2))
    launch = w.codec.launch

    def launched(chunks, lane=False):  # eager, marked as the lane's as Codec.launch marks it
        log.append(("launch", len(chunks), lane))
        out = launch(chunks)
        out.lane = lane
        return out

    w.codec.launch = launched
    polls: dict[int, int] = {}

    def done(launched) -> bool:  # each group still decoding at its first two polls
        polls[id(launched)] = polls.get(id(launched), 0) + 1
        return polls[id(launched)] > 2

    w.codec.done = done
    w.gather, w.to_gateway, w.status, w.inbox = Gather(0.03, 8), Recorder(log), Status(), Inbox(arrivals)
    w.counters = {"codec_calls_total": 0, "codec_windows_total": 0, "codec_busy_seconds_total": 0.0,
                  "codec_first_lane_windows_total": 0}  # fmt: skip
    return w


def test_a_first_chunk_arriving_during_a_pass_is_sent_before_the_pass_and_ends_wait_for_it(program):
    log: list = []
    rest = [window(f"s{i}", 3, slack_ms=500) for i in range(4)]
    arrivals = [
        # during the urgent group: a new stream's first chunk, the end of s1 (its last window is in
        # the pass), and s2's next window (it keeps waiting for the next pass)
        [
            DetokBatch(
                chunks=[window("late", 0, rows=7), window("s2", 4, slack_ms=500)],
                finished=[Finished("s1", FinishReason.STOP)],
            )
        ],
        [],
        [DetokBatch(chunks=[window("later", 0, rows=7)], finished=[])],  # during the rest's decode
    ]
    w = worker(program, log, arrivals)
    w._decode_and_send([([window("new", 0)], []), (rest, [Finished("s0", FinishReason.STOP)])])
    sends = [e for e in log if e[0] == "send"]
    assert sends == [
        ("send", ["late"], []),  # the lane's, while the urgent group decodes
        ("send", ["new"], []),
        ("send", ["later"], []),  # while the rest decodes
        ("send", ["s0", "s1", "s2", "s3"], [("s0", FinishReason.STOP)]),
        ("send", [], [("s1", FinishReason.STOP)]),  # after the pass's audio
    ]
    launches = [e for e in log if e[0] == "launch"]
    assert launches == [("launch", 1, False), ("launch", 4, False), ("launch", 1, True), ("launch", 1, True)]
    assert [c.rid for c in w.gather.chunks] == ["s2"]  # not a first chunk: the next pass's
    assert w.counters["codec_first_lane_windows_total"] == 2 and w.counters["codec_windows_total"] == 7


def test_an_end_that_comes_during_the_pass_of_a_request_it_fails_is_not_sent_after_its_error(program):
    log: list = []
    w = worker(program, log, [[], [], [DetokBatch(chunks=[], finished=[Finished("bad", FinishReason.STOP)])]])
    collect = w.codec.collect

    def failing(launched):  # the group with "bad" fails when read back, after its end came
        if any(c.rid == "bad" for c in launched.chunks):
            raise RuntimeError("device fault")
        return collect(launched)

    w.codec.collect = failing
    w._decode_and_send([([window("new", 0)], []), ([window("bad", 3, slack_ms=500)], [])])
    ends = [(rid, reason) for e in log if e[0] == "send" for rid, reason in e[2]]
    assert ends == [("bad", FinishReason.ERROR)]  # its error alone, once
    assert "bad" not in w.codec.dead  # its own end came and went: nothing left to drop


def test_the_lane_takes_a_graphs_worth_of_a_kind_at_a_time_and_the_rest_waits_for_the_pass(program):
    log: list = []
    firsts = [window(f"f{i}", 0, rows=7) for i in range(5)]
    w = worker(program, log, [[DetokBatch(chunks=firsts, finished=[])]])
    w._decode_and_send([([window("new", 0)], [])])
    assert [e for e in log if e[0] == "launch"] == [
        ("launch", 1, False),
        ("launch", 2, True),
        ("launch", 2, True),
    ]
    assert [c.rid for c in w.gather.chunks] == ["f4"]  # the group ended before the lane took it


def test_the_lane_takes_second_chunks_of_tail_kinds_and_no_later_tail(program):
    log: list = []
    arrivals = [
        [
            DetokBatch(
                chunks=[
                    window("a", 1, rows=14, tail=7),  # a second chunk after a one-frame lead
                    window("b", 1, rows=28, tail=7),  # ... after a three-frame lead
                    window("c", 2, rows=21, tail=7, slack_ms=500),  # a third: the next pass's
                    window("d", 1, rows=28, slack_ms=500),  # a regular window (switched at once)
                ],
                finished=[],
            )
        ]
    ]
    w = worker(program, log, arrivals)
    assert w.codec.second_kinds() == {(14, 7), (21, 7), (28, 7)}
    w._decode_and_send([([window("new", 0)], [])])
    assert [e for e in log if e[0] == "launch"] == [("launch", 1, False), ("launch", 2, True)]
    assert [e[1] for e in log if e[0] == "send"][0] == ["a", "b"]
    assert sorted(c.rid for c in w.gather.chunks) == ["c", "d"]


def test_without_the_lane_a_pass_reads_nothing_while_it_decodes(program):
    log: list = []
    w = worker(program, log, [[DetokBatch(chunks=[window("late", 0, rows=7)], finished=[])]])
    w.codec.lane = None
    w._decode_and_send([([window("new", 0)], [])])
    assert [e for e in log if e[0] == "send"] == [("send", ["new"], [])]  # nothing read meanwhile
    assert w.inbox.batches and not w.gather.chunks  # left in the inbox for the next turn


def test_the_gather_gives_up_what_the_lane_takes_and_the_ends_of_requests_left_with_nothing():
    g = Gather(0.03, 8)
    g.add(DetokBatch(chunks=[window("a", 0), window("b", 2, slack_ms=300), window("c", 0)],
                     finished=[Finished("a", FinishReason.STOP), Finished("b", FinishReason.STOP)]), 0.0)  # fmt: skip
    assert g.take_where(lambda c: False) == ([], [])
    firsts, ends = g.take_where(lambda c: c.index == 0)
    assert [c.rid for c in firsts] == ["a", "c"] and [f.rid for f in ends] == ["a"]
    assert [c.rid for c in g.chunks] == ["b"] and [f.rid for f in g.finished] == ["b"]
    assert g.deadline == 0.03  # b's own: the gather's wait (its slack lasts longer), not a first chunk's now
    taken, ends = g.take_where(lambda c: True)
    assert [c.rid for c in taken] == ["b"] and [f.rid for f in ends] == ["b"]
    assert not g.chunks and not g.due(10.0) and g.deadline == float("inf")


def test_the_lane_exists_with_graphs_only_and_takes_first_chunks_of_lead_kinds(program):
    codec = Codec(program, max_batch=8, graphs=False, first_lane=True)
    assert codec.lane is None and not codec.lane_takes(window("a", 0, rows=program.detok_lead[0]))
    assert not parse_role("codec_worker", ["--model", "orpheus-tiny"], {}).cfg.codec.first_lane
    cfg = parse_role("codec_worker", ["--model", "orpheus-tiny", "--codec-first-lane"], {}).cfg
    assert cfg.codec.first_lane
    # the gpu_worker counts on the lane for second chunks where the codec has graphs on a GPU
    assert codec_lane(cfg, "cuda", program) and codec_lane(cfg, "cuda:1", program)
    assert not codec_lane(cfg, "cpu", program)
    assert not codec_lane(cfg, "cuda", types.SimpleNamespace(codec_streams=True))  # not for codec streams
    gpu_cfg = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--codec-first-lane"], {}).cfg
    assert codec_lane(gpu_cfg, "cuda", program)
    assert not codec_lane(parse_role("gpu_worker", ["--model", "orpheus-tiny"], {}).cfg, "cuda", program)
    # the share of the capacity up to which the gpu_worker allows the lane's trip
    assert gpu_cfg.codec.first_lane_room == LANE_ROOM == 0.5
    room = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--codec-first-lane-room", "0.8"], {})
    assert room.cfg.codec.first_lane_room == 0.8
    with pytest.raises(ValueError, match="--codec-first-lane-room is a share of the capacity"):
        CodecSettings(first_lane_room=1.5).check()


def test_the_lanes_decodes_do_not_count_in_the_pass_time_the_gather_plans_with(program):
    log: list = []
    w = worker(program, log, [[DetokBatch(chunks=[window("late", 0, rows=7)], finished=[])]])
    launch = w.codec.launch

    def slow_lane(chunks, lane=False):
        if lane:
            time.sleep(0.2)  # a lane decode far longer than this pass
        return launch(chunks, lane)

    w.codec.launch = slow_lane
    w._decode_and_send([([window("new", 0)], [])])
    assert [e[1] for e in log if e[0] == "send"] == [["late"], ["new"]]
    assert w.gather.decode_s < 0.1
