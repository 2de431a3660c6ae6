"""A window the program's codec rejects fails only its own request: the windows decoded in the same
batch get their audio (the audio they have alone), and the ends held with them go on."""

from __future__ import annotations

import torch

from codec_worker.codec import Codec
from codec_worker.gather import Gather
from codec_worker.worker import CodecWorker
from common.messages import AudioChunks, DetokBatch, DetokChunk, Finished, FinishReason
from programs import get_spec
from programs.orpheus.program import OrpheusProgram

AUDIO_BASE = 128266


class StrictOrpheus(OrpheusProgram):
    """Orpheus's program whose codec raises on a token outside a window's audio codes (eager)."""

    def detokenize(self, tokens, keys, tail_rows=0, streams=None):
        code = tokens - AUDIO_BASE - 4096 * (torch.arange(tokens.shape[1]) % 7)[None, :, None]
        if ((code < 0) | (code >= 4096)).any():
            raise ValueError("a code out of range")
        return super().detokenize(tokens, keys, tail_rows)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[AudioChunks] = []

    def send(self, msg: AudioChunks) -> None:
        self.sent.append(msg)


class Status:
    def set_load(self, *args) -> None:
        pass


def window(rid: str, index: int, bad: bool = False) -> DetokChunk:
    gen = torch.Generator().manual_seed(index + 100 * len(rid))
    tokens = AUDIO_BASE + 4096 * (torch.arange(28) % 7) + torch.randint(0, 4096, (28,), generator=gen)
    if bad:
        tokens[9] += 4096 * 7  # a code out of its codebook's range
    return DetokChunk(rid, index, 5, tokens.int().numpy().astype("<i4").tobytes(), index, slack_ms=500)


def test_one_bad_window_fails_its_request_and_the_batch_keeps_its_audio() -> None:
    program = StrictOrpheus(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_codec()
    w = CodecWorker.__new__(CodecWorker)  # no sockets: the pass logic alone
    w.codec = Codec(program, max_batch=8, graphs=False)
    w.gather, w.to_gateway, w.status = Gather(10.0, 1000), Recorder(), Status()
    w.counters = {"codec_calls_total": 0, "codec_windows_total": 0, "codec_busy_seconds_total": 0.0}
    chunks = [window("a", 3), window("b", 5), window("bad", 2, bad=True), window("c", 1), window("a", 4)]
    w.receive([DetokBatch(chunks=chunks, finished=[Finished("b", FinishReason.STOP)])], 0.0)
    w.decode_pass()
    [msg] = w.to_gateway.sent
    assert [(a.rid, a.index) for a in msg.chunks] == [("a", 3), ("b", 5), ("c", 1), ("a", 4)]
    for a, c in zip(msg.chunks, [chunks[i] for i in (0, 1, 3, 4)], strict=True):
        [alone] = w.codec.decode([c])
        assert a.pcm and a.pcm == alone.pcm
    assert [(f.rid, f.reason, f.status) for f in msg.finished] == [
        ("bad", FinishReason.ERROR, 500),
        ("b", FinishReason.STOP, 0),
    ]
    assert "out of range" in msg.finished[0].message
    # The failed request's later windows are dropped, and so is its own end.
    w.receive(
        [
            DetokBatch(
                chunks=[window("bad", 3), window("c", 2)], finished=[Finished("bad", FinishReason.STOP)]
            )
        ],
        0.0,
    )
    w.decode_pass()
    assert [a.rid for a in w.to_gateway.sent[-1].chunks] == ["c"] and not w.to_gateway.sent[-1].finished
    assert not w.codec.dead
