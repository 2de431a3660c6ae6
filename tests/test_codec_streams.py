"""Codec streams through the codec worker's pass logic (gather, rounds, slots, ends), with a small
stateful program: Orpheus's program with a running-sum codec, each frame's samples a function of
the sum of every frame of its stream so far. A wrong slot, a missed reset, a reordering or a
double decode changes the audio, which must equal the codec's decode of the whole stream."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from codec_worker.gather import Gather
from codec_worker.worker import CodecWorker
from common.config import CodecSettings
from common.messages import AudioChunks, DetokBatch, DetokChunk, Finished, FinishReason
from common.options import parse_role
from programs import get_spec
from programs.base import CodecStreams, LMProgram, pcm16
from programs.orpheus.program import OrpheusProgram

ROWS, SPF, MOD = 3, 8, 65521  # rows per window, samples per frame, the sum's modulus


class RunningSumProgram(OrpheusProgram):
    """Orpheus's program with a stateful codec: slot state = the running sum of its stream's codes."""

    codec_streams = True

    def __init__(self, device: str = "cpu") -> None:
        spec = get_spec("orpheus-tiny")
        spec.update(detok_interval=ROWS, detok_overlap=0, detok_samples=ROWS * SPF, detok_lead=[])
        spec.update(detok_tail=False, detok_offset=0)
        super().__init__(spec, load_format="dummy", device=device)

    def load_codec(self) -> None:
        pass

    def init_codec_streams(self, n_slots: int) -> None:
        self.state = torch.full(
            (n_slots,), 12345, dtype=torch.int64, device=self.device
        )  # not 0: a missed reset shows

    def frames(self, sums: torch.Tensor) -> torch.Tensor:
        """Running sums [..., T] → audio [..., T * SPF] in [-1, 1]."""
        k = torch.arange(1, SPF + 1, device=sums.device)
        return ((sums[..., None] * k) % MOD).flatten(-2).double().div(MOD / 2).sub(1).float()

    def detokenize(self, tokens, keys, tail_rows=0, streams: CodecStreams | None = None):
        assert streams is not None
        codes = tokens[:, :, 0]  # [Bd, R]
        if codes.device.type == "cpu" and codes.min() < 0:  # a host check: eager only
            raise ValueError("a negative code")
        start = torch.where(streams.fresh, 0, self.state[streams.slot])
        sums = start[:, None] + codes.cumsum(1)  # [Bd, R]
        self.state[streams.slot] = sums[:, -1]
        return self.frames(sums), torch.ones(len(codes), dtype=torch.bool, device=codes.device)

    def decode_all(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole stream's audio: codes [T] → [T * SPF]."""
        return self.frames(codes.cumsum(0))


class Recorder:
    def __init__(self) -> None:
        self.sent: list[AudioChunks] = []

    def send(self, msg: AudioChunks) -> None:
        self.sent.append(msg)


class Status:
    def set_load(self, *args) -> None:
        pass


def worker(slots: int, idle_s: float = 60.0, clock=None, device: str = "cpu") -> CodecWorker:
    w = CodecWorker.__new__(CodecWorker)  # no sockets: the pass logic alone
    program = RunningSumProgram(device)
    w.codec = Codec(program, max_batch=4, graphs=device != "cpu", streams=slots, idle_s=idle_s)
    if clock is not None:
        w.codec.slots.clock = clock
    w.gather, w.to_gateway, w.status = Gather(10.0, 1000), Recorder(), Status()
    w.counters = {"codec_calls_total": 0, "codec_windows_total": 0, "codec_busy_seconds_total": 0.0}
    return w


def chunk(rid: str, index: int, codes: np.ndarray, prefix: np.ndarray | None = None) -> DetokChunk:
    """Window `index` of `codes` (rows of one code), with `prefix`'s rows as a primed stream's."""
    rows = codes[index * ROWS : (index + 1) * ROWS].astype("<i4")
    c = DetokChunk(rid, index, 0, rows.tobytes(), index, slack_ms=0 if index == 0 else 1000)
    if prefix is not None:
        c.prefix = prefix.astype("<i4").tobytes()
    return c


def played(w: CodecWorker) -> tuple[dict[str, bytes], dict[str, Finished]]:
    """Each request's PCM as the gateway would play it, and its end; fails on a chunk out of order."""
    pcm: dict[str, list[bytes]] = {}
    ends: dict[str, Finished] = {}
    for msg in w.to_gateway.sent:
        for a in msg.chunks:
            got = pcm.setdefault(a.rid, [])
            assert a.index == len(got) and a.rid not in ends, f"{a.rid} chunk {a.index} out of order"
            got.append(a.pcm)
        for f in msg.finished:
            assert f.rid not in ends, f"{f.rid} ended twice"
            ends[f.rid] = f
    return {rid: b"".join(p) for rid, p in pcm.items()}, ends


def expected(w: CodecWorker, codes: np.ndarray) -> bytes:
    audio = w.codec.program.decode_all(torch.from_numpy(codes.astype(np.int64))).cpu()
    return pcm16(audio).numpy().astype("<i2").tobytes()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_streams_decode_as_whole_streams_and_free_their_slots(device: str) -> None:
    """On a GPU through the codec graphs: padding entries decode in the scratch slot."""
    rng = random.Random(0)
    # 5 requests at once (the gpu_worker's batch), 10 slots: a request's slot is freed once its end
    # has passed the codec, after its last chunks, while new requests may already have started.
    w = worker(slots=10, device=device)
    codes = {f"r{i}": np.random.default_rng(i).integers(0, 5000, ROWS * rng.randint(1, 7)) for i in range(14)}
    # Each request's chunks, then its end, in order; requests start as slots allow (<= 5 at once).
    todo = {rid: [chunk(rid, j, c) for j in range(len(c) // ROWS)] for rid, c in codes.items()}
    waiting, running = list(todo), []
    while waiting or running:
        while waiting and len(running) < 5:
            running.append(waiting.pop(0))
        batch = DetokBatch(chunks=[])
        for rid in rng.sample(running, k=rng.randint(1, len(running))):
            for _ in range(rng.randint(1, 3)):  # several chunks of one request in one step, at times
                if todo[rid]:
                    batch.chunks.append(todo[rid].pop(0))
            if not todo[rid]:
                batch.finished.append(Finished(rid, FinishReason.STOP))
                running.remove(rid)
        w.receive([batch], 0.0)
        if rng.random() < 0.4:  # gathered over several steps, then decoded in rounds
            w.decode_pass()
    w.decode_pass()
    pcm, ends = played(w)
    assert set(ends) == set(codes) and all(f.reason == FinishReason.STOP for f in ends.values())
    for rid, c in codes.items():
        assert pcm[rid] == expected(w, c), rid
    slots = w.codec.slots
    assert sorted(slots.free) == list(range(10)) and not slots.owner  # every slot back
    assert w.counters["codec_windows_total"] == sum(len(c) // ROWS for c in codes.values())


def test_a_reused_slot_starts_fresh() -> None:
    w = worker(slots=1)
    a, b = np.arange(1, 10), np.arange(100, 109)
    for rid, c in (("a", a), ("b", b)):
        w.receive([DetokBatch(chunks=[chunk(rid, j, c) for j in range(3)])], 0.0)
        w.decode_pass()
        w.receive([DetokBatch(chunks=[], finished=[Finished(rid, FinishReason.STOP)])], 0.0)
    pcm, ends = played(w)
    assert pcm == {"a": expected(w, a), "b": expected(w, b)} and set(ends) == {"a", "b"}


def test_a_later_chunk_without_a_slot_fails_only_its_request() -> None:
    w = worker(slots=3)
    c = np.arange(1, 13)
    # "lost" starts at chunk 2: its stream's state is not here (a restarted codec worker).
    w.receive([DetokBatch(chunks=[chunk("ok", 0, c), chunk("lost", 2, c), chunk("ok", 1, c)])], 0.0)
    w.decode_pass()
    w.receive([DetokBatch(chunks=[chunk("lost", 3, c), chunk("ok", 2, c)])], 0.0)
    w.decode_pass()
    ends = [Finished("ok", FinishReason.STOP), Finished("lost", FinishReason.STOP)]
    w.receive([DetokBatch(chunks=[chunk("ok", 3, c)], finished=ends)], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert pcm == {"ok": expected(w, c)}  # none of "lost"'s later chunks, and "ok" whole
    assert ends["ok"].reason == FinishReason.STOP
    lost = ends["lost"]  # its error, once; its own end is dropped
    assert lost.reason == FinishReason.ERROR and lost.status == 500 and "codec state" in lost.message
    assert len(w.codec.slots.free) == 3 and not w.codec.dead


def test_no_free_slot_takes_back_an_idle_one_or_fails_the_new_request() -> None:
    now = [0.0]
    w = worker(slots=2, idle_s=30.0, clock=lambda: now[0])
    c = np.arange(1, 10)
    w.receive([DetokBatch(chunks=[chunk("a", 0, c), chunk("b", 0, c)])], 0.0)
    w.decode_pass()
    now[0] = 20.0
    w.receive([DetokBatch(chunks=[chunk("b", 1, c), chunk("busy", 0, c)])], 0.0)
    w.decode_pass()
    _, ends = played(w)
    busy = ends["busy"]  # both slots in use within the bound: the new request fails
    assert busy.reason == FinishReason.ERROR and busy.status == 503 and "codec streams" in busy.message
    now[0] = 40.0  # "a" idle 40 s (its gpu_worker gone): its slot goes to the new request
    w.receive([DetokBatch(chunks=[chunk("new", 0, c), chunk("new", 1, c), chunk("new", 2, c)])], 0.0)
    w.decode_pass()
    w.receive([DetokBatch(chunks=[chunk("a", 1, c)], finished=[Finished("new", FinishReason.STOP)])], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert pcm["new"] == expected(w, c)
    assert ends["a"].reason == FinishReason.ERROR and ends["a"].status == 500
    w.receive([DetokBatch(chunks=[chunk("b", 2, c)], finished=[Finished("b", FinishReason.STOP)])], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert pcm["b"] == expected(w, c) and ends["b"].reason == FinishReason.STOP
    assert sorted(w.codec.slots.free) == [0, 1]


def test_a_failed_stream_batch_fails_its_requests_and_frees_their_slots() -> None:
    w = worker(slots=4)
    good, bad = np.arange(1, 4), np.array([1, -5, 2])
    w.receive([DetokBatch(chunks=[chunk("good", 0, good), chunk("bad", 0, bad)])], 0.0)
    w.decode_pass()
    _, ends = played(w)
    assert {rid: f.status for rid, f in ends.items()} == {"good": 500, "bad": 500}
    assert len(w.codec.slots.free) == 4


def test_codec_streams_exclude_overlap_and_need_slots() -> None:
    class Overlapping(RunningSumProgram):
        def __init__(self) -> None:
            spec = get_spec("orpheus-tiny")
            spec.update(detok_lead=[])
            OrpheusProgram.__init__(self, spec, load_format="dummy")

    with pytest.raises(ValueError, match="each row once"):
        Overlapping()
    with pytest.raises(ValueError, match="codec slots"):
        Codec(RunningSumProgram(), graphs=False)

    class NoSlots(LMProgram):
        name = "no-slots"

    with pytest.raises(NotImplementedError, match="no-slots"):
        NoSlots.init_codec_streams(NoSlots.__new__(NoSlots), 4)


def test_codec_slots_come_from_the_flag_or_the_gpu_batch() -> None:
    s = parse_role("codec_worker", ["--codec-streams", "40"], {})
    assert s.cfg.codec.max_streams == 40 and s.cfg.codec.streams_for(256) == 40
    assert parse_role("codec_worker", [], {"VOXPIPE_CODEC_STREAMS": "7"}).cfg.codec.max_streams == 7
    assert CodecSettings().streams_for(256) == 2 * 256 + 16
    with pytest.raises(ValueError, match="codec-streams"):
        CodecSettings(max_streams=-1).check()


@pytest.mark.parametrize("device", DEVICES)
def test_a_primed_stream_continues_its_prefix_and_its_slot_serves_the_next_request_clean(device: str) -> None:
    """Chunk 0's prefix (programs/base.py, "Codec streams": primed streams) decodes first in the
    request's slot, its audio dropped: the request's audio is the tail of the whole decode of prefix
    and codes. Prefixes of any length, two primed in one round, and a request in a slot a primed
    one used starts fresh. On a GPU the windows replay graphs after the eager prime."""
    w = worker(slots=2, device=device)
    c = {rid: np.random.default_rng(i).integers(1, 5000, 3 * ROWS) for i, rid in enumerate("pqrs")}
    prefix = {"p": np.arange(7, 14), "r": np.array([4000])}  # 7 rows (not a window's 3) and 1
    w.receive([DetokBatch(chunks=[chunk("p", 0, c["p"], prefix["p"]), chunk("q", 0, c["q"])])], 0.0)
    w.decode_pass()
    ended = [Finished("q", FinishReason.STOP)]
    w.receive([DetokBatch(chunks=[chunk(r, j, c[r]) for r in "pq" for j in (1, 2)], finished=ended)], 0.0)
    w.decode_pass()  # "q"'s slot is free: "r" primes in it
    w.receive(
        [
            DetokBatch(
                chunks=[chunk("r", 0, c["r"], prefix["r"])], finished=[Finished("p", FinishReason.STOP)]
            )
        ],
        0.0,
    )
    w.decode_pass()  # "p"'s slot is free: "s" starts fresh in it
    rest = [chunk("r", j, c["r"]) for j in (1, 2)] + [chunk("s", j, c["s"]) for j in range(3)]
    w.receive([DetokBatch(chunks=rest, finished=[Finished(r, FinishReason.STOP) for r in "rs"])], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert set(ends) == set("pqrs") and all(f.reason == FinishReason.STOP for f in ends.values())
    for rid in "pr":  # the whole decode of prefix + codes, the prefix's samples cut off
        whole = expected(w, np.concatenate([prefix[rid], c[rid]]))
        assert pcm[rid] == whole[2 * SPF * len(prefix[rid]) :], rid
        assert pcm[rid] != expected(w, c[rid]), f"{rid}: the prefix changes the audio"
    for rid in "qs":
        assert pcm[rid] == expected(w, c[rid]), rid
    assert sorted(w.codec.slots.free) == [0, 1]


def test_a_bad_prefix_fails_only_its_request() -> None:
    """A prefix on a later chunk, one not of whole rows, or one the codec fails on, ends its own
    request with an error; the others in its pass keep their audio, and every slot comes back."""
    w = worker(slots=4)
    c = np.arange(1, 10)
    later = chunk("later", 1, c, np.arange(3))
    torn = chunk("torn", 0, c, np.arange(3))
    torn.prefix = torn.prefix[:-2]
    failing = chunk("failing", 0, c, np.array([1, -5]))  # the program raises on a negative code
    firsts = [chunk("later", 0, c), torn, failing, chunk("ok", 0, c)]
    w.receive([DetokBatch(chunks=firsts + [later, chunk("ok", 1, c), chunk("ok", 2, c)])], 0.0)
    w.decode_pass()
    ends = [Finished(r, FinishReason.STOP) for r in ("later", "torn", "failing", "ok")]
    w.receive([DetokBatch(chunks=[], finished=ends)], 0.0)
    w.decode_pass()
    pcm, ends = played(w)
    assert pcm["ok"] == expected(w, c) and ends["ok"].reason == FinishReason.STOP
    for rid, why in (("later", "only a chunk 0"), ("torn", "not rows"), ("failing", "negative code")):
        assert ends[rid].reason == FinishReason.ERROR and ends[rid].status == 500, rid
        assert why in ends[rid].message, ends[rid].message
    assert sorted(w.codec.slots.free) == [0, 1, 2, 3] and not w.codec.dead
