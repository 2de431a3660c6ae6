"""The one place that makes ZeroMQ sockets: the address book, typed channels and taps.

Call sites never see zmq or msgpack: they hold a `PushChannel[T]` / `PullChannel[T]` (or the
asyncio variants) that encode and decode one tagged union each. Bound sockets belong to the
receiver of a stream (gateway inbox, codec inbox); senders connect, so any number of senders
(tokenizer workers, several gpu_workers) can join and leave. The two pools are pull-based instead,
both dispatched by the gateway: tokenizer workers ask for one request at a time (`requests`),
gpu_workers for as many prompts as they have free slots (`gpu_in`); their channels are in
`common.pool`, which makes its sockets with `make_socket` here (this module never imports it).
Prompts travel tokenizer_worker → gateway_in → gateway → gpu_in → the gpu_worker with free capacity.

Every address is written the way a connecting process reaches it (`tcp://gateway:5557`,
`ipc:///run/x/requests`); the process that binds it derives its bind address (`bind_address`), so
one address book serves every process of a deployment.

CURVE: with `use_curve(DIR)` (`--zmq-curve-dir`, keys from `voxpipe keys DIR`) every tcp:// socket
this factory makes is encrypted, binding sockets admit only clients whose public key is in
DIR/authorized, and connecting sockets pin the server's public key (ipc:// stays as it is, guarded by
its 0700 directory). Taps on tcp:// are CURVE servers too (`voxpipe tap --zmq-curve-dir DIR`). It is
on by default where it matters: `secure_sockets` refuses a process whose addresses (its tap's
among them) reach beyond this host (not ipc://, not loopback) unless it has keys, or is told
`--zmq-insecure`.

Taps: `install_tap(addr, proc)` gives the process an XPUB socket on which every send of every
channel (and every `publish_stage` event) is mirrored as [TapHeader, message bytes]. Mirroring
happens only while someone subscribes; otherwise a send pays one clock read and a comparison.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
import threading
import time
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

# pyzmq imports it at the first send without a copy of a frame past zmq.COPY_THRESHOLD (a pass of
# audio, say): at startup, not inside a pass.
import zmq.utils.garbage  # noqa: F401

from common import curve
from common.curve import CurveKeys, create_curve_keys, ensure_curve_keys, use_curve  # noqa: F401 (re-exported)
from common.messages import StageEvent, TapHeader

log = logging.getLogger(__name__)

T = TypeVar("T")

# Enough to absorb bursts; a full queue blocks the sender (backpressure) rather than dropping.
_HWM = 100_000
# A tap drops rather than blocks: a slow `voxpipe tap` must never slow the pipeline.
_TAP_HWM = 10_000

# Default tcp ports of the separate-services deployment (README "Running as separate services").
DEFAULT_PORTS = {"requests": 5557, "gateway_in": 5558, "gpu_in": 5559, "codec_in": 5560}

# Which side of each address a role holds: it binds the streams it receives, connects to the rest.
ROLE_SOCKETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gateway": (("requests", "gateway_in", "gpu_in"), ("codec_in",)),  # codec_in: clips to encode
    "tokenizer_worker": ((), ("requests", "gateway_in")),
    "gpu_worker": ((), ("gpu_in", "codec_in", "gateway_in")),
    "codec_worker": (("codec_in",), ("gateway_in",)),
}


class Addresses(msgspec.Struct, frozen=True):
    """Where each receiving socket is, as a connecting process reaches it. Every process gets the
    same book."""

    requests: str  # gateway ROUTER (bind) ↔ tokenizer workers DEALER (connect), see common.pool
    gpu_in: str  # gateway ROUTER (bind) ↔ gpu_workers DEALER (connect): prompts, aborts
    codec_in: str  # codec_worker PULL (bind) ← its gpu_worker, the gateway's clips (one per pair, `numbered`)
    gateway_in: str  # gateway PULL (bind) ← codec_workers, tokenizer workers (prompts), status of all

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

    @classmethod
    def tcp(cls, host: str = "127.0.0.1", ports: dict[str, int] | None = None) -> Addresses:
        """tcp:// sockets on one host name (the separate-services defaults use 127.0.0.1)."""
        ports = {**DEFAULT_PORTS, **(ports or {})}
        return cls(**{f: f"tcp://{host}:{ports[f]}" for f in cls.__struct_fields__})


def numbered(addr: str, index: int) -> str:
    """The `index`-th of several addresses derived from one (a codec_in per gpu_worker/codec_worker
    pair): ipc:// paths get a `.index` suffix, tcp:// ports count up from the given one."""
    if addr.startswith("tcp://"):
        host, port = _split_tcp(addr)
        return f"tcp://{host}:{int(port) + index}"
    return f"{addr}.{index}"


def _split_tcp(addr: str) -> tuple[str, str]:
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{addr!r} is not a tcp://HOST:PORT address")
    return host, port


def is_wildcard(addr: str) -> bool:
    return addr.startswith("tcp://") and _split_tcp(addr)[0] in ("*", "0.0.0.0", "::", "[::]")


def bind_address(addr: str) -> str:
    """The address a binding process binds for `addr`: ipc:// and IP literals as given (127.0.0.1
    stays loopback-only), `localhost` as 127.0.0.1, and any other host name (a service name such
    as `gateway`, which is this process's own) as every interface, `tcp://*:PORT`."""
    if not addr.startswith("tcp://"):
        return addr
    host, port = _split_tcp(addr)
    if host in ("*", "0.0.0.0", "::", "[::]"):
        return addr
    if host == "localhost":
        return f"tcp://127.0.0.1:{port}"
    try:
        ipaddress.ip_address(host.strip("[]"))
        return addr
    except ValueError:
        return f"tcp://*:{port}"


# --- CURVE: whether this process needs it ---------------------------------------------------------


def is_loopback(addr: str) -> bool:
    """Whether only this host can reach `addr`: ipc:// and inproc://, or tcp:// on a loopback
    address (127.0.0.0/8, ::1, localhost). A wildcard or any other host is reachable from others."""
    if not addr.startswith("tcp://"):
        return addr.startswith(("ipc://", "inproc://"))
    host = _split_tcp(addr)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secure_sockets(key_dir: str, addrs: list[str], insecure: bool = False) -> None:
    """CURVE for this process's tcp:// sockets as the deployment needs it: on with `key_dir`
    (created with fresh keys when it does not exist, so processes sharing a volume agree on the
    first one's); without keys, a process any of whose `addrs` other hosts can reach is refused,
    unless `insecure`. Raises ValueError saying what to set."""
    if key_dir:
        if not zmq.has("curve"):
            raise ValueError(
                f"--zmq-curve-dir {key_dir}: this libzmq ({zmq.zmq_version()}) has no CURVE support; "
                "install a pyzmq wheel (bundled libzmq with libsodium)"
            )
        if ensure_curve_keys(key_dir):
            log.warning("created CURVE keys in %s: processes on other hosts need a copy of it", key_dir)
        use_curve(key_dir)
        return
    exposed = [a for a in addrs if not is_loopback(a)]
    if exposed and not insecure:
        raise ValueError(
            f"{exposed[0]} is reachable from other hosts, so its ZeroMQ peers must authenticate: create "
            "keys with `voxpipe keys DIR` and give every process --zmq-curve-dir DIR "
            "(VOXPIPE_ZMQ_CURVE_DIR), or --zmq-insecure (VOXPIPE_ZMQ_INSECURE=1) on a network you trust"
        )
    if exposed:
        log.warning("tcp:// sockets on %s without CURVE (--zmq-insecure): any peer is trusted", exposed[0])


def make_socket(
    ctx: zmq.Context, kind: int, addr: str, bind: bool, options: dict[int, Any] | None = None
) -> zmq.Socket:
    """A socket of `kind` bound or connected to `addr`, with the deployment's limits, heartbeats
    and CURVE keys: every socket of the pipeline is made here."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    if addr.startswith("tcp://"):
        # ZMTP heartbeats: a peer whose host or container vanished is dropped within seconds, so
        # a dispatcher stops counting on it and a reconnect starts cleanly.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        curve.apply(ctx, sock, bind)
    for opt, value in (options or {}).items():
        sock.setsockopt(opt, value)
    if bind:
        sock.bind(bind_address(addr))
    else:
        if is_wildcard(addr):
            raise ValueError(f"cannot connect to {addr!r}: it is a bind address; give the host name")
        sock.connect(addr)
    return sock


# --- taps -----------------------------------------------------------------------------------------


class Tap:
    """An XPUB socket mirroring this process's sends. XPUB (not PUB) so the process learns whether
    anyone subscribes and skips the mirror entirely when nobody does; subscriptions are read at
    most every `CHECK_S`, so a new subscriber sees messages within that much of connecting."""

    CHECK_S = 0.05

    def __init__(self, addr: str, proc: str, ctx: zmq.Context | None = None) -> None:
        self.addr = addr
        self.proc = proc
        ctx = ctx or zmq.Context.instance()
        self._sock = ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _TAP_HWM)
        if addr.startswith("tcp://"):
            curve.apply(ctx, self._sock, bind=True)  # a tap shows every request's text
        self._sock.bind(bind_address(addr))
        self._enc = msgspec.msgpack.Encoder()
        self._topics: set[bytes] = set()
        self._next_check = 0.0
        self._owner = threading.get_ident()
        self.listening = False

    def poll(self) -> bool:
        """Whether anyone subscribes (cheap: reads subscriptions at most every CHECK_S)."""
        if threading.get_ident() != self._owner:
            return False  # zmq sockets are single-thread: other threads never mirror
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.CHECK_S
            while True:
                try:
                    sub = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sub[:1] == b"\x01":
                    self._topics.add(sub[1:])
                elif sub[:1] == b"\x00":
                    self._topics.discard(sub[1:])
            self.listening = bool(self._topics)
        return self.listening

    def send(self, payload: bytes, addr: str = "", peer: str = "", t: float | None = None) -> None:
        header = self._enc.encode(TapHeader(self.proc, time.time() if t is None else t, addr, peer))
        try:
            self._sock.send_multipart([header, payload], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # the subscriber is behind: drop, never block

    def stage(self, rid: str, stage: str, t: float | None = None, **detail: str | int | float) -> None:
        self.send(self._enc.encode(StageEvent(rid, stage, time.time() if t is None else t, detail)))

    def close(self) -> None:
        self._sock.close(linger=0)


_tap: Tap | None = None


def install_tap(addr: str, proc: str) -> Tap:
    """Mirror this process's sends on a tap bound at `addr` (`--tap` / VOXPIPE_TAP)."""
    global _tap
    if _tap is not None:
        _tap.close()
    _tap = Tap(addr, proc)
    log.info("tap on %s", addr)
    return _tap


def tap_listening() -> bool:
    """True while someone subscribes to this process's tap (gate any work done only for taps)."""
    return _tap is not None and _tap.poll()


def publish_stage(rid: str, stage: str, t: float | None = None, **detail: str | int | float) -> None:
    """A StageEvent on this process's tap; costs ~nothing when nobody listens."""
    if _tap is not None and _tap.poll():
        _tap.stage(rid, stage, t, **detail)


def mirror(payload: bytes, addr: str, peer: str = "", t: float | None = None) -> None:
    """Mirror a send on the tap; `t` is when it was sent (default now)."""
    if _tap is not None and _tap.poll():
        _tap.send(payload, addr, peer, t)


# --- channels -------------------------------------------------------------------------------------


class PushChannel(Generic[T]):
    """Sends messages of one union type. `bind=False` (connect) is the usual side for senders.
    `tap=False` for channels used off the main thread (heartbeats) or not worth mirroring."""

    def __init__(
        self, addr: str, bind: bool = False, ctx: zmq.Context | None = None, tap: bool = True
    ) -> None:
        self._sock = make_socket(ctx or zmq.Context.instance(), zmq.PUSH, addr, bind)
        self._enc = msgspec.msgpack.Encoder()
        self._addr = addr if tap else ""

    def send(self, msg: T) -> None:
        data = self._enc.encode(msg)
        if self._addr and _tap is not None and _tap.poll():
            _tap.send(data, self._addr)  # before the real send, so a tap sees causes before effects
        self._sock.send(data, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


def _decoded(dec: msgspec.msgpack.Decoder, frame: zmq.Frame) -> Any | None:
    """`frame` decoded; None for a malformed one (logged, and the receiver serves on)."""
    try:
        return dec.decode(frame.buffer)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("dropped a malformed message (%d bytes): %s", len(frame.buffer), e)
        return None


def _take_queued(sock: zmq.Socket, dec: msgspec.msgpack.Decoder, out: list, frames: int) -> None:
    """Up to `frames` frames queued at `sock` now (no wait), decoded into `out`, malformed ones
    skipped."""
    for _ in range(frames):
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        msg = _decoded(dec, frame)
        if msg is not None:
            out.append(msg)


class PullChannel(Generic[T]):
    """Receives one union type. Messages that do not decode are logged and dropped: a peer's bug
    or a stranger on the socket must never take the receiver down."""

    def __init__(self, addr: str, msg_type: Any, bind: bool = True, ctx: zmq.Context | None = None) -> None:
        self._sock = make_socket(ctx or zmq.Context.instance(), zmq.PULL, addr, bind)
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
        if self._poller.poll(timeout_ms):
            _take_queued(self._sock, self._dec, out, limit)
        return out

    def _decode(self, frame: zmq.Frame) -> T | None:
        return _decoded(self._dec, frame)

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPushChannel(Generic[T]):
    def __init__(
        self, addr: str, bind: bool = False, ctx: zmq.asyncio.Context | None = None, tap: bool = True
    ) -> None:
        self._sock = make_socket(ctx or zmq.asyncio.Context.instance(), zmq.PUSH, addr, bind)
        self._enc = msgspec.msgpack.Encoder()
        self._addr = addr if tap else ""

    async def send(self, msg: T) -> None:
        data = self._enc.encode(msg)
        if self._addr and _tap is not None and _tap.poll():
            _tap.send(data, self._addr)
        await self._sock.send(data, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPullChannel(Generic[T]):
    def __init__(
        self, addr: str, msg_type: Any, bind: bool = True, ctx: zmq.asyncio.Context | None = None
    ) -> None:
        self._sock = make_socket(ctx or zmq.asyncio.Context.instance(), zmq.PULL, addr, bind)
        # The same socket without the asyncio layer: what is queued already is taken without a
        # future, a readiness check and a handler update per message (`recv_batch`).
        self._now = zmq.Socket.shadow(self._sock.underlying)
        self._dec = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        """The next message that decodes; malformed ones are logged and skipped."""
        while True:
            msg = self._decode(await self._sock.recv(copy=False))
            if msg is not None:
                return msg

    async def recv_batch(self, limit: int = 256) -> list[T]:
        """The next message that decodes and those queued behind it (at most `limit` in all): one
        wait for a burst of messages instead of one each. Malformed ones are logged and skipped."""
        out: list[T] = []
        while not out:
            msg = self._decode(await self._sock.recv(copy=False))
            if msg is not None:
                out.append(msg)
            _take_queued(self._now, self._dec, out, limit - 1)
        return out

    def _decode(self, frame: zmq.Frame) -> T | None:
        return _decoded(self._dec, frame)

    def close(self) -> None:
        self._sock.close(linger=0)
