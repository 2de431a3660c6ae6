"""The gateway's side of the encode service: a clip's features, encoded once, shared, cached.

A request with a reference clip needs the program's features of it (programs/base.py, "Reference
audio"), which the codec_worker computes (codec_worker/encode.py). `References.encode(clip)`:

- a clip encoded before comes from the cache, keyed by the hash of its resampled audio (an LRU
  bounded in bytes, --reference-cache-mb), so a repeated voice costs nothing;
- a clip being encoded for another request is waited for with it: one encode per clip at a time;
- otherwise an `EncodeRequest` goes to a ready codec_worker (in turn among them), and the request
  waits for its `EncodeReply` (the inbox task routes it here: `resolve`) without blocking
  anything else. No ready codec_worker is a 503 at once; one that dies with clips in hand fails
  them with a 503 (`fail_worker`); no reply within --encode-timeout is a 504.

The features themselves are wire arrays (`common.messages.VoiceFeatures`): they go on as they came
back, into each request's `GenerateRequest.voice`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable

from common.config import ServeConfig
from common.ipc import PushChannel, numbered
from common.messages import Array, EncodeReply, EncodeRequest
from gateway.clips import Clip
from gateway.events import Failed

log = logging.getLogger(__name__)

Features = dict[str, Array]


def features_bytes(features: Features) -> int:
    return sum(len(a.data) for a in features.values()) + 64 * len(features)


class References:
    """Encodes clips through the codec_workers, sharing and caching the results."""

    def __init__(self, codec_in: str, cfg: ServeConfig, ready: Callable[[], list[str]]) -> None:
        self._codec_in = codec_in
        self._pairs = cfg.gpu_workers
        self._channels: dict[str, PushChannel[EncodeRequest]] = {}  # by address
        self._turn = itertools.count()
        self._ready = ready  # the names of the codec_workers ready now
        self.cache_bytes = cfg.gateway.reference_cache_mb << 20  # --reference-cache-mb
        self.timeout_s = cfg.gateway.encode_timeout
        self._cache: OrderedDict[str, Features] = OrderedDict()
        self._cached_bytes = 0
        # key → (the future every request with this clip awaits, the codec_worker encoding it)
        self._inflight: dict[str, tuple[asyncio.Future[Features | Failed], str]] = {}
        self.encodes_sent = 0  # EncodeRequests sent (the cache and sharing keep this low)

    async def encode(self, clip: Clip, text: str = "") -> Features | Failed:
        """The clip's features, or a Failed with the HTTP status to answer."""
        hit = self._cache.get(clip.key)
        if hit is not None:
            self._cache.move_to_end(clip.key)
            return hit
        entry = self._inflight.get(clip.key)
        if entry is None:
            sent = self._send(clip, text)
            if isinstance(sent, Failed):
                return sent
            entry = self._inflight[clip.key] = sent
        try:
            # shield: a request that goes away leaves the encode to the others waiting for it
            return await asyncio.wait_for(asyncio.shield(entry[0]), self.timeout_s)
        except asyncio.TimeoutError:
            late = Failed(
                504, f"the reference clip was not encoded within {self.timeout_s:g} s (--encode-timeout)"
            )
            self._settle(clip.key, late)  # the others waiting for it started later: they fail too
            return late

    def _send(self, clip: Clip, text: str) -> tuple[asyncio.Future[Features | Failed], str] | Failed:
        """Send the clip to a ready codec_worker → (the future its reply settles, the worker)."""
        picked = self._pick()
        if picked is None:
            return Failed(503, "no codec_worker is ready to encode the reference clip; retry, see /ready")
        name, addr = picked
        chan = self._channels.get(addr)
        if chan is None:
            chan = self._channels[addr] = PushChannel(addr)
        audio = Array("<f4", [len(clip.audio)], clip.audio.tobytes())
        chan.send(EncodeRequest(clip.key, audio, text))
        self.encodes_sent += 1
        return asyncio.get_running_loop().create_future(), name

    def _pick(self) -> tuple[str, str] | None:
        """The next ready codec_worker in turn and its codec_in address, or None when none is. With
        several pairs, pair i's codec_worker is `<name>.i` and binds the i-th codec_in (as `voxpipe
        serve` numbers them)."""
        ready = []
        for name in self._ready():
            if self._pairs == 1:
                ready.append((name, self._codec_in))
                continue
            index = name.rpartition(".")[2]
            if index.isdigit() and int(index) < self._pairs:
                ready.append((name, numbered(self._codec_in, int(index))))
        return ready[next(self._turn) % len(ready)] if ready else None

    def resolve(self, reply: EncodeReply) -> None:
        """A codec_worker's reply: cache the features and wake the requests waiting for them."""
        if reply.error:
            status = reply.status if 400 <= reply.status < 600 else 500
            self._settle(reply.key, Failed(status, reply.error))
            return
        bad = next((f"{n!r}: {a.error()}" for n, a in reply.features.items() if a.error()), "")
        if bad:
            self._settle(reply.key, Failed(500, f"the codec_worker sent unreadable features ({bad})"))
            return
        self.remember(reply.key, reply.features)
        self._settle(reply.key, reply.features)

    def remember(self, key: str, features: Features) -> None:
        """Keep `features` in the cache, dropping the least recently used beyond its bytes."""
        size = features_bytes(features)
        if size > self.cache_bytes:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_bytes -= features_bytes(old)
        self._cache[key] = features
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= features_bytes(dropped)

    def fail_worker(self, name: str) -> None:
        """A codec_worker stopped: the clips it was encoding fail with a 503."""
        for key, (_, holder) in list(self._inflight.items()):
            if holder == name:
                self._settle(key, Failed(503, f"{name} stopped while encoding the reference clip; retry"))

    def _settle(self, key: str, result: Features | Failed) -> None:
        entry = self._inflight.pop(key, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(result)

    def close(self) -> None:
        for chan in self._channels.values():
            chan.close()
        for key in list(self._inflight):
            self._settle(key, Failed(503, "the gateway is shutting down; retry"))
