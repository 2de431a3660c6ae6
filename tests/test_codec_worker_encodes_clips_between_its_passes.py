"""The codec_worker's encode service (csm-tiny's Mimi encoder on the CPU): windows gathered go out
before a clip is encoded, each pass encodes a bounded batch (so a window waits for at most one),
a clip the encoders refuse fails alone with a 400 while the others of its batch get their codes,
and no codec slot is taken or lost by encoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from codec_worker.encode import Encodes
from codec_worker.gather import Gather
from codec_worker.worker import CodecWorker
from common.arrays import np_array, wire_array
from common.messages import (
    AudioChunks,
    DetokBatch,
    DetokChunk,
    EncodeReply,
    EncodeRequest,
    Finished,
    FinishReason,
)
from programs import get_spec
from programs.base import Reference
from programs.csm.program import CsmProgram

RATE = 24000


class PickyCsm(CsmProgram):
    """CSM whose encoders refuse a clip that clips (a peak at full scale), as a real encoder may
    refuse what it cannot encode: the whole batch raises."""

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        if any(np.abs(c.audio).max() >= 1.0 for c in clips):
            raise ValueError("the clip is clipped")
        return super().encode_references(clips)


class Inbox:
    """What the codec_in socket hands the worker's loop, queued by the test."""

    def __init__(self) -> None:
        self.queued: list = []

    def drain(self, timeout_ms: int = 0) -> list:
        out, self.queued = self.queued, []
        return out


class Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


class Status:
    def set_load(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def program() -> PickyCsm:
    torch.set_num_threads(1)
    p = PickyCsm(get_spec("csm-tiny"), load_format="dummy")
    p.load_codec()
    p.load_encoders()
    return p


def worker(program: PickyCsm, pass_seconds: float = 1.0) -> CodecWorker:
    w = CodecWorker.__new__(CodecWorker)  # the loop's logic over stand-ins for its sockets
    w.codec = Codec(program, max_batch=8, graphs=False, streams=4)
    w.gather = Gather(10.0, 1000)  # nothing comes due by itself: the test decides
    w.encodes = Encodes(program, pass_seconds=pass_seconds)
    w.inbox, w.to_gateway, w.status = Inbox(), Outbox(), Status()
    w.counters = {k: 0 for k in ("codec_calls_total", "codec_windows_total", "codec_busy_seconds_total")}
    w.counters.update(encode_clips_total=0, encode_busy_seconds_total=0.0)
    w.decoded_last = False
    return w


def clip(key: str, seconds: float, seed: int, peak: float = 0.5) -> EncodeRequest:
    audio = np.random.default_rng(seed).uniform(-peak, peak, int(RATE * seconds)).astype(np.float32)
    return EncodeRequest(key, wire_array(audio), "some text")


def window(rid: str, index: int) -> DetokChunk:
    codes = np.random.default_rng(index).integers(0, 2048, 32).astype("<i4")
    return DetokChunk(rid, index, 1, codes.tobytes(), index, slack_ms=500)


def alone(program: PickyCsm, req: EncodeRequest) -> np.ndarray:
    return program.encode_references([Reference(np_array(req.audio).copy())])[0]["codes"]


def test_gathered_windows_go_first_and_each_pass_encodes_a_bounded_batch(program) -> None:
    w = worker(program, pass_seconds=1.0)
    clips = [clip(f"k{i}", 0.6, i) for i in range(3)]  # 0.6 s each: one clip per 1 s pass
    w.inbox.queued = [*clips, DetokBatch(chunks=[window("s", 0)])]
    kinds = []
    for turn in range(5):
        if turn == 2:  # a window arrives while clips are still waiting: it goes before the next one
            w.inbox.queued = [DetokBatch(chunks=[window("s", 1)])]
        before = len(w.to_gateway.sent)
        w.turn(0.0)
        kinds.append([type(m).__name__ for m in w.to_gateway.sent[before:]])
    assert kinds == [["AudioChunks"], ["EncodeReply"], ["AudioChunks"], ["EncodeReply"], ["EncodeReply"]]
    replies = [m for m in w.to_gateway.sent if isinstance(m, EncodeReply)]
    assert [r.key for r in replies] == ["k0", "k1", "k2"]
    for req, reply in zip(clips, replies, strict=True):
        assert not reply.error
        np.testing.assert_array_equal(np_array(reply.features["codes"]), alone(program, req))
    audio = [c for m in w.to_gateway.sent if isinstance(m, AudioChunks) for c in m.chunks]
    assert [(c.rid, c.index) for c in audio] == [("s", 0), ("s", 1)] and all(
        len(c.pcm) == 2 * 1920 for c in audio
    )
    assert w.counters["encode_clips_total"] == 3


def test_a_clip_is_encoded_while_windows_arrive_every_turn(program) -> None:
    """A busy codec (windows in every turn, as under load) still encodes: decode and encode passes
    take turns while clips wait, so neither waits for more than one pass of the other."""
    w = worker(program, pass_seconds=1.0)
    w.inbox.queued = [clip("k0", 0.6, 0), clip("k1", 0.6, 1), DetokBatch(chunks=[window("s", 0)])]
    kinds = []
    for turn in range(6):
        before = len(w.to_gateway.sent)
        w.turn(0.0)
        kinds.append([type(m).__name__ for m in w.to_gateway.sent[before:]])
        w.inbox.queued = [DetokBatch(chunks=[window("s", turn + 1)])]  # the next step's window
    # (turn() is given a drain long past, so every window is due: without the turns, no clip would be
    # encoded while windows keep coming)
    assert kinds == [["AudioChunks"], ["EncodeReply"], ["AudioChunks"], ["EncodeReply"], ["AudioChunks"]] + [
        ["AudioChunks"]
    ]
    assert not w.encodes.waiting
    audio = [c.index for m in w.to_gateway.sent if isinstance(m, AudioChunks) for c in m.chunks]
    assert audio == list(range(6))


def test_a_clip_arriving_after_idle_decodes_go_after_the_windows_it_came_with(program) -> None:
    """A decode pass with no clip waiting hands nothing to the encoder: a clip that comes later
    with windows still lets those windows go first."""
    w = worker(program)
    w.gather = Gather(0.0, 1000)  # windows come due at once
    kinds = []
    turns = (
        [DetokBatch(chunks=[window("s", 0)])],
        [],
        [clip("k0", 0.6, 0), DetokBatch(chunks=[window("s", 1)])],
        [],
    )
    for queued in turns:
        w.inbox.queued = queued
        before = len(w.to_gateway.sent)
        w.turn(0.0)
        kinds.append([type(m).__name__ for m in w.to_gateway.sent[before:]])
    assert kinds == [["AudioChunks"], [], ["AudioChunks"], ["EncodeReply"]]


def test_short_clips_share_a_pass_up_to_its_bound(program) -> None:
    w = worker(program, pass_seconds=1.0)
    w.inbox.queued = [clip(f"k{i}", 0.3, i) for i in range(5)]  # 3 fit in 1 s, then 2
    w.turn(0.0)
    assert [m.key for m in w.to_gateway.sent] == ["k0", "k1", "k2"]
    w.turn(0.0)
    assert [m.key for m in w.to_gateway.sent] == ["k0", "k1", "k2", "k3", "k4"]
    assert not w.encodes.waiting


def test_a_refused_clip_fails_alone_and_no_codec_slot_is_touched(program) -> None:
    w = worker(program, pass_seconds=10.0)
    w.receive([DetokBatch(chunks=[window("s", 0)])], 0.0)
    w.decode_pass()  # a stream holds a codec slot
    free = sorted(w.codec.slots.free)
    good, bad, other = clip("good", 0.3, 1), clip("bad", 0.3, 2, peak=1.0), clip("other", 0.2, 3)
    bad.audio = wire_array(np.concatenate([np_array(bad.audio), [1.0]]).astype(np.float32))
    wrong = EncodeRequest("wrong", wire_array(np.zeros((2, 3), np.float32)))  # not mono samples
    w.inbox.queued = [good, bad, other, wrong]
    w.turn(0.0)  # the malformed one is refused at once, the three in one pass
    replies = {m.key: m for m in w.to_gateway.sent if isinstance(m, EncodeReply)}
    assert replies["wrong"].status == 400 and "mono" in replies["wrong"].error
    assert replies["bad"].status == 400 and "clipped" in replies["bad"].error and not replies["bad"].features
    for req in (good, other):
        np.testing.assert_array_equal(np_array(replies[req.key].features["codes"]), alone(program, req))
    assert sorted(w.codec.slots.free) == free, "encoding takes no codec slot"
    w.receive([DetokBatch(chunks=[window("s", 1)], finished=[Finished("s", FinishReason.STOP)])], 0.0)
    w.decode_pass()  # the stream goes on in its slot and ends, handing it back
    assert [(c.rid, c.index) for c in w.to_gateway.sent[-1].chunks] == [("s", 1)]
    assert sorted(w.codec.slots.free) == list(range(4))
