"""The one place that makes ZeroMQ sockets: the address book and typed channels.

Call sites never see zmq or msgpack: they hold a `PushChannel[T]` / `PullChannel[T]` (or the
asyncio variants) that encode and decode one tagged union each. Bound sockets belong to the
receiver of a stream (gateway inbox, gpu_worker inbox, codec inbox); senders connect, so any
number of senders (tokenizer workers, several gpu_workers) can join and leave.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

T = TypeVar("T")

# Enough to absorb bursts; a full queue blocks the sender (backpressure) rather than dropping.
_HWM = 100_000


class Addresses(msgspec.Struct, frozen=True):
    """Where each receiving socket is bound. Every process gets the same book."""

    requests: str  # gateway PUSH (bind) → tokenizer workers PULL (connect)
    gpu_in: str  # gpu_worker PULL (bind) ← tokenizer workers (prompts), gateway (aborts)
    codec_in: str  # codec_worker PULL (bind) ← gpu_worker
    gateway_in: str  # gateway PULL (bind) ← codec_worker, tokenizer workers, status of all

    @classmethod
    def local(cls, run_dir: str | None = None) -> Addresses:
        """ipc:// sockets in a private (0700) directory, for one host."""
        if run_dir is None:
            run_dir = tempfile.mkdtemp(prefix="voxpipe-")
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        os.chmod(run_dir, 0o700)
        p = os.path.join
        return cls(
            requests=f"ipc://{p(run_dir, 'requests')}",
            gpu_in=f"ipc://{p(run_dir, 'gpu_in')}",
            codec_in=f"ipc://{p(run_dir, 'codec_in')}",
            gateway_in=f"ipc://{p(run_dir, 'gateway_in')}",
        )


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class PushChannel(Generic[T]):
    """Sends messages of one union type. `bind=False` (connect) is the usual side for senders."""

    def __init__(self, addr: str, bind: bool = False, ctx: zmq.Context | None = None) -> None:
        self._sock = _socket(ctx or zmq.Context.instance(), zmq.PUSH, addr, bind)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: T) -> None:
        self._sock.send(self._enc.encode(msg), copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class PullChannel(Generic[T]):
    """Receives one union type. Messages that do not decode are logged and dropped: a peer's bug
    or a stranger on the socket must never take the receiver down."""

    def __init__(self, addr: str, msg_type: Any, bind: bool = True, ctx: zmq.Context | None = None) -> None:
        self._sock = _socket(ctx or zmq.Context.instance(), zmq.PULL, addr, bind)
        self._dec = msgspec.msgpack.Decoder(msg_type)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """One message, or None after `timeout_ms` (None = wait forever) or on a bad message."""
        if timeout_ms is not None and not self._poller.poll(timeout_ms):
            return None
        return self._decode(self._sock.recv(copy=False))

    def drain(self, timeout_ms: int = 0, limit: int = 100_000) -> list[T]:
        """Everything queued now; waits up to `timeout_ms` for the first message."""
        out: list[T] = []
        if not self._poller.poll(timeout_ms):
            return out
        while len(out) < limit:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self._decode(frame)
            if msg is not None:
                out.append(msg)
        return out

    def _decode(self, frame: zmq.Frame) -> T | None:
        try:
            return self._dec.decode(frame.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("dropped a malformed message (%d bytes): %s", len(frame.buffer), e)
            return None

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPushChannel(Generic[T]):
    def __init__(self, addr: str, bind: bool = False, ctx: zmq.asyncio.Context | None = None) -> None:
        self._sock = _socket(ctx or zmq.asyncio.Context.instance(), zmq.PUSH, addr, bind)
        self._enc = msgspec.msgpack.Encoder()

    async def send(self, msg: T) -> None:
        await self._sock.send(self._enc.encode(msg), copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPullChannel(Generic[T]):
    def __init__(
        self, addr: str, msg_type: Any, bind: bool = True, ctx: zmq.asyncio.Context | None = None
    ) -> None:
        self._sock = _socket(ctx or zmq.asyncio.Context.instance(), zmq.PULL, addr, bind)
        self._dec = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        """The next message that decodes; malformed ones are logged and skipped."""
        while True:
            frame = await self._sock.recv(copy=False)
            try:
                return self._dec.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("dropped a malformed message (%d bytes): %s", len(frame.buffer), e)

    def close(self) -> None:
        self._sock.close(linger=0)
