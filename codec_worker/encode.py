"""The encode service: reference clips → the program's features (programs/base.py, "Reference audio").

The gateway sends each clip it has not encoded yet as an `EncodeRequest` (keyed by the hash of its
audio); the codec_worker queues them and, between its codec passes, encodes a bounded batch in one
`encode_references` call (`take`): at most `ENCODE_MAX_CLIPS` clips and `ENCODE_PASS_SECONDS` of
audio, so one pass delays the next codec windows by no more than one clip's worth of encoding. Each
clip gets an `EncodeReply` with its features or an error: a batch that raises is encoded again
clip by clip, so one bad clip fails alone (a ValueError is the clip's fault: 400; anything else
500). No sockets here: testable alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from common.arrays import np_array, wire_array
from common.messages import EncodeReply, EncodeRequest
from programs.base import LMProgram, Reference

log = logging.getLogger(__name__)

ENCODE_MAX_CLIPS = 8  # clips per encode_references call
ENCODE_PASS_SECONDS = 30.0  # audio per call (at least one clip, whatever its length)
QUEUE_MAX = 1024  # clips waiting; beyond it a clip is refused at once (503) rather than queued


class Encodes:
    """The clips waiting to be encoded, and the encoding of a batch of them."""

    def __init__(self, program: LMProgram, pass_seconds: float = ENCODE_PASS_SECONDS) -> None:
        self.program = program
        self.rate = program.reference_sample_rate
        self.pass_samples = int(pass_seconds * max(self.rate, 1))
        self.queue: OrderedDict[str, EncodeRequest] = OrderedDict()  # key → clip, oldest first

    @property
    def waiting(self) -> bool:
        return bool(self.queue)

    def add(self, req: EncodeRequest) -> EncodeReply | None:
        """Queue a clip; → an error reply at once for one that cannot be encoded here."""
        if self.rate <= 0:
            return EncodeReply(req.key, error=f"{self.program.name} takes no reference audio", status=400)
        a = req.audio
        if a.dtype != "<f4" or len(a.shape) != 1 or not a.shape[0] or a.error():
            return EncodeReply(
                req.key, error=f"a clip is float32 mono samples, not {a.dtype} {a.shape}", status=400
            )
        if len(self.queue) >= QUEUE_MAX and req.key not in self.queue:
            return EncodeReply(
                req.key, error=f"{QUEUE_MAX} clips are waiting to be encoded; retry", status=503
            )
        self.queue[req.key] = req  # the same clip twice is encoded once (the gateway dedupes too)
        return None

    def take(self) -> list[EncodeRequest]:
        """The next batch: the oldest clips up to ENCODE_MAX_CLIPS and `pass_samples` of audio."""
        batch: list[EncodeRequest] = []
        samples = 0
        while self.queue and len(batch) < ENCODE_MAX_CLIPS:
            key, req = next(iter(self.queue.items()))
            n = req.audio.shape[0]
            if batch and samples + n > self.pass_samples:
                break
            del self.queue[key]
            batch.append(req)
            samples += n
        return batch

    def encode(self, batch: list[EncodeRequest]) -> list[EncodeReply]:
        """One reply per clip of `batch`, in order."""
        clips = [Reference(np.array(np_array(r.audio), dtype=np.float32), r.text) for r in batch]
        try:
            return [self._reply(r, f) for r, f in zip(batch, self._features(clips), strict=True)]
        except Exception as e:
            if len(batch) == 1:
                return [self._failed(batch[0], e)]
            log.warning("encoding %d clips failed (%s); encoding them one by one", len(batch), e)
            return [self.encode([r])[0] for r in batch]

    def _features(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        with torch.inference_mode():
            out = self.program.encode_references(clips)
        if len(out) != len(clips):
            raise RuntimeError(f"encode_references returned {len(out)} feature sets for {len(clips)} clips")
        return out

    @staticmethod
    def _reply(req: EncodeRequest, features: dict[str, np.ndarray]) -> EncodeReply:
        return EncodeReply(req.key, {name: wire_array(a) for name, a in features.items()})

    @staticmethod
    def _failed(req: EncodeRequest, error: Exception) -> EncodeReply:
        if isinstance(error, ValueError):
            return EncodeReply(req.key, error=f"the reference clip was refused: {error}", status=400)
        log.error("encoding clip %s failed: %s: %s", req.key[:12], type(error).__name__, error)
        return EncodeReply(req.key, error=f"encoder error: {type(error).__name__}: {error}", status=500)
