"""Pull-based work distribution for a pool of identical workers (the tokenizer pool).

PUSH/PULL deals messages round-robin to whoever is connected, so work queues behind a busy or
slow worker, and a worker that leaves takes its queue with it. Here the dispatcher (gateway side,
ROUTER, bound) holds the queue, and each worker (DEALER, connects) asks for one message at a time:

    worker ──WorkerReady(seq)──▶ dispatcher      "I am free" (repeated every second while idle)
    worker ◀──── one message ─── dispatcher      the oldest waiting message (urgent ones first), to the longest-free worker
    worker ──WorkerLeaving─────▶ dispatcher      on SIGTERM: send nothing more
    worker ◀───── LeaveAck ───── dispatcher      after anything already sent to it

So a worker started later takes work from its first announcement; a busy worker is never sent a
second message (a free one may be handed a run of them at once, below); a leaving worker finishes
what was already on its way (it arrives before the ack) and loses nothing. `seq` (messages received
so far) lets the dispatcher ignore an announcement that crossed a message on the wire. With
ROUTER_MANDATORY a message to a worker that vanished fails at once and goes to the next free one
instead.

Runs (`burst` > 1, the tokenizer pool): where more messages wait than workers are free, each free
one-at-a-time worker is handed its share of them at once, up to `burst`, and takes them in turn
before it says it is free again. A burst of requests then costs a round trip per run instead of
one per message (a prompt builds in ~0.05 ms, the round trip through both event loops takes
several times that). A message only joins a run when it would wait for a worker anyway, a worker
given a run is busy until it asks again, and a slow message holds up the rest of its run (at most
`burst` - 1 others) where another worker might have taken them.

Credits: a worker that takes several messages at once (a gpu_worker, which batches requests) says
in WorkerReady how many more it can take (`credits`, its free slots); the dispatcher hands it at
most that many (less what it sent since that announcement's `seq`) and sends each message to the
worker with the most credit, so prompts go to free capacity, never into a full worker's queue. Such
a worker announces again whenever its credit or seq changes (`CreditWorkChannel.offer`). Messages
outside the pool protocol (`broadcast`: the gateway's Aborts) are not counted.

A worker killed (SIGKILL, crash) while holding a message loses it here; the gateway, which records
which worker took each request, learns of the death (`gateway.procs`) and sends a dead tokenizer
worker's requests again, or fails a gpu_worker's with an explicit 503
(`gateway.pipeline.Pipeline._fail_held_by`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from common.ipc import make_socket, mirror
from common.messages import LeaveAck, PoolWorkerMsg, WorkerLeaving, WorkerReady

log = logging.getLogger(__name__)

T = TypeVar("T")

REANNOUNCE_S = 1.0  # an idle worker repeats WorkerReady this often (finds a restarted gateway)
LEAVE_TIMEOUT_MS = 1000  # a leaving worker waits this long for LeaveAck (the gateway may be gone)


class AsyncDispatchChannel(Generic[T]):
    """Gateway side: `await send(msg)` hands `msg` to one free worker, in arrival order (urgent
    messages ahead of the others), and
    returns once a worker has it; while every worker is busy (or none is connected) it waits, so a
    timeout around it means "no worker took it". Same shape as AsyncPushChannel."""

    def __init__(
        self,
        addr: str,
        bind: bool = True,
        ctx: zmq.asyncio.Context | None = None,
        greeting: Any = None,
        burst: int = 1,
    ) -> None:
        """`greeting`: a message sent to each worker the first time it announces itself, before
        anything else it gets from this dispatcher (outside the pool protocol, like `broadcast`);
        `burst`: the most messages a one-at-a-time worker is handed at once where more wait than
        workers are free (runs, above; 1: one at a time)."""
        self.burst = max(1, burst)
        self._greeting = None if greeting is None else msgspec.msgpack.encode(greeting)
        self._sock = make_socket(
            ctx or zmq.asyncio.Context.instance(), zmq.ROUTER, addr, bind, {zmq.ROUTER_MANDATORY: 1}
        )
        self._addr = addr
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(PoolWorkerMsg)
        self._free: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # id → name
        self._credit: dict[bytes, int] = {}  # id → messages it can still take (free ones only)
        self._sent: dict[bytes, int] = {}  # worker id → messages handed to it
        self._known: dict[bytes, str] = {}  # every worker that announced and has not left
        self._waiting: collections.deque[tuple[bytes, asyncio.Future[bytes]]] = collections.deque()
        self._urgent: set[int] = set()  # id() of the urgent items in `_waiting` (all at its front)
        self._task: asyncio.Task[None] | None = None
        self.dispatched: collections.Counter[str] = collections.Counter()  # worker name → messages
        self.runs = 0  # hand-outs of more than one message at once to a one-at-a-time worker

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def _n_urgent(self) -> int:
        return len(self._urgent)

    @property
    def workers(self) -> dict[bytes, str]:
        """Every connected worker that announced itself (id → name), free or not."""
        return dict(self._known)

    def start(self) -> None:
        """Start reading announcements now (else on the first `send`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._recv_loop(), name="dispatch-recv")

    async def send(self, msg: T, urgent: bool = False) -> bytes:
        """Returns the id of the worker that took `msg`. An `urgent` message waits ahead of every
        other one (behind earlier urgent ones)."""
        self.start()
        item = (self._enc.encode(msg), asyncio.get_running_loop().create_future())
        if urgent:
            self._waiting.insert(self._n_urgent, item)
            self._urgent.add(id(item))
        else:
            self._waiting.append(item)
        self._pump()
        try:
            return await item[1]
        except BaseException:
            # Cancelled (a timeout, the client gone) before a worker took it: never send it later.
            if not item[1].done() or item[1].cancelled():
                item[1].cancel()
                try:
                    self._waiting.remove(item)
                except ValueError:
                    pass
                self._urgent.discard(id(item))
            raise

    def _pump(self) -> None:
        """Hand waiting messages to free workers, oldest first on both sides (the urgent ones lead);
        with `burst`, runs to one-at-a-time workers where more wait than are free (`_runs`)."""
        runs = self._runs()
        try:
            self._hand_out()
        finally:
            for ident, share in runs.items():
                left = self._credit[ident] if ident in self._free else 0  # a spent run left `_free`
                self.runs += share - left > 1
                if left == share:  # took none of it: free, one at a time
                    self._credit[ident] = 1
                elif left:  # took part of it: busy until it asks again
                    del self._free[ident]
                    del self._credit[ident]

    def _runs(self) -> dict[bytes, int]:
        """With `burst` > 1 and more messages waiting than workers free: each free one-at-a-time
        worker's credit raised to its share of them (at most `burst`) → those workers and shares."""
        if self.burst <= 1 or not self._free:
            return {}
        # Counted only up to what fills every free worker's run: a burst's queue is long, and the pump
        # runs for each message that comes.
        enough, live = self.burst * len(self._free), 0
        for _, fut in self._waiting:
            live += not fut.done()
            if live >= enough:
                break
        share = min(self.burst, -(-live // len(self._free)))
        if share <= 1:
            return {}
        runs = {ident: share for ident in self._free if self._credit.get(ident, 1) == 1}
        self._credit.update(runs)
        return runs

    def _hand_out(self) -> None:
        while self._waiting and self._free:
            data, fut = self._waiting[0]
            if fut.done():
                self._urgent.discard(id(self._waiting.popleft()))
                continue
            # The most credit wins; among equals the longest free (the first in `_free`).
            ident = max(self._free, key=lambda i: self._credit.get(i, 1))
            name = self._free[ident]
            self._credit[ident] = self._credit.get(ident, 1) - 1
            if self._credit[ident] <= 0:
                del self._free[ident]
                self._credit.pop(ident, None)
            sent_at = time.time()  # the tap's time is the send's: the worker may answer first
            if not self._send_now(ident, data):
                self._free.pop(ident, None)
                self._credit.pop(ident, None)
                continue  # that worker is gone: try the next one
            self._urgent.discard(id(self._waiting.popleft()))
            self._sent[ident] = self._sent.get(ident, 0) + 1
            self.dispatched[name] += 1
            mirror(data, self._addr, peer=name, t=sent_at)
            fut.set_result(ident)

    def broadcast(self, msg: Any) -> int:
        """Send `msg` to every known worker, outside the pool protocol (not counted against credit);
        returns how many took it."""
        data = self._enc.encode(msg)
        sent = 0
        for ident, name in list(self._known.items()):
            if self._send_now(ident, data):
                mirror(data, self._addr, peer=name)
                sent += 1
        return sent

    def send_to(self, ident: bytes, msg: Any) -> bool:
        """Send `msg` to one known worker, outside the pool protocol (not counted against credit,
        as `broadcast`); False when it is gone."""
        name = self._known.get(ident)
        if name is None:
            return False
        data = self._enc.encode(msg)
        if not self._send_now(ident, data):
            return False
        mirror(data, self._addr, peer=name)
        return True

    def _send_now(self, ident: bytes, data: bytes) -> bool:
        # NOBLOCK sends resolve at once (pyzmq tries them before queueing), and never queue
        # behind one another, so the future is always done here.
        fut = self._sock.send_multipart([ident, data], flags=zmq.NOBLOCK, copy=False)
        err = fut.exception() if fut.done() else None
        if err is not None:
            log.info("pool worker %r unreachable (%s); dropping it", ident, err)
            self._sent.pop(ident, None)
            self._known.pop(ident, None)
            return False
        return True

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped a malformed pool message (%d frames)", len(frames))
                continue
            ident, data = frames
            try:
                msg = self._dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("dropped a malformed pool message (%d bytes): %s", len(data), e)
                continue
            try:
                self._handle(ident, msg)
            except Exception:
                log.exception("failed to handle %s from pool worker %r", type(msg).__name__, ident)
            self._pump()

    def _handle(self, ident: bytes, msg: WorkerReady | WorkerLeaving) -> None:
        match msg:
            case WorkerReady(name=name, seq=seq, credits=credits):
                if ident not in self._known and self._greeting is not None:
                    self._send_now(ident, self._greeting)
                    mirror(self._greeting, self._addr, peer=name)
                self._known[ident] = name
                # A seq behind what we sent it: that many messages crossed this announcement on the
                # wire and use up its credit. A seq ahead (a restarted dispatcher): trust the worker.
                sent = max(self._sent.get(ident, 0), seq)
                self._sent[ident] = sent
                credit = credits - (sent - seq)
                if credit > 0:
                    if ident not in self._free:
                        self._free[ident] = name
                        log.debug("pool worker %s is free (%d)", name, credit)
                    self._credit[ident] = credit
                else:
                    self._free.pop(ident, None)
                    self._credit.pop(ident, None)
            case WorkerLeaving(name=name):
                self._free.pop(ident, None)
                self._credit.pop(ident, None)
                self._known.pop(ident, None)
                self._sent.pop(ident, None)
                self._send_now(ident, self._enc.encode(LeaveAck(name)))
                log.info("pool worker %s left", name)
            case _:
                raise TypeError(f"unexpected pool message {type(msg).__name__}")

    async def aclose(self) -> None:
        """Close, and let the reading task finish its cancellation before the loop goes away."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.close()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for _, fut in self._waiting:
            if not fut.done():
                fut.set_exception(ConnectionError("the dispatcher closed before a worker took the message"))
        self._waiting.clear()
        self._urgent.clear()
        self._sock.close(linger=0)


class _WorkerSide(Generic[T]):
    """State shared by the sync and asyncio worker sides: identity, counters, decoding."""

    def __init__(self, msg_type: Any, name: str, uncounted: tuple[type, ...] = ()) -> None:
        self.name = name
        self._uncounted = uncounted  # message types sent outside the pool protocol (broadcasts)
        # Unique per connection: a ROUTER refuses a second peer with the same id.
        self.identity = f"{name}/{uuid.uuid4().hex[:8]}".encode()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(msg_type | LeaveAck)
        self._seq = 0  # messages received
        self._asked_at: float | None = None  # monotonic time of the last WorkerReady; None = not asked
        self.acked = False

    def _ready_due(self) -> bool:
        return self._asked_at is None or time.monotonic() - self._asked_at >= REANNOUNCE_S

    def _ready(self, credits: int = 1) -> bytes:
        self._asked_at = time.monotonic()
        return self._enc.encode(WorkerReady(self.name, self._seq, credits))

    def _decode(self, data: bytes) -> T | None:
        try:
            msg = self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("dropped a malformed message (%d bytes): %s", len(data), e)
            return None
        if isinstance(msg, LeaveAck):
            self.acked = True
            return None
        if isinstance(msg, self._uncounted):
            return msg
        self._seq += 1
        self._asked_at = None  # busy now: the next recv() announces again
        return msg


class WorkChannel(_WorkerSide[T]):
    """Worker side: `recv()` says "I am free" and waits for one message; `leave()` ends it."""

    def __init__(self, addr: str, msg_type: Any, name: str, ctx: zmq.Context | None = None) -> None:
        super().__init__(msg_type, name)
        self._sock = make_socket(
            ctx or zmq.Context.instance(), zmq.DEALER, addr, False, {zmq.ROUTING_ID: self.identity}
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """One message, or None after `timeout_ms` (None = wait forever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            # not while a message is already here (the rest of a run): free only once it is taken
            if self._ready_due() and not self._poller.poll(0):
                self._send(self._ready())
            wait = (self._asked_at or time.monotonic()) + REANNOUNCE_S - time.monotonic()
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if self._poller.poll(max(0, int(wait * 1000))):
                msg = self._decode(self._sock.recv())
                if msg is not None:
                    return msg
            elif deadline is not None and time.monotonic() >= deadline:
                return None

    def _send(self, data: bytes) -> None:
        # Never block: with no dispatcher connected (not up yet, or a peer that is not one) a
        # DEALER send would wait forever; a dropped announcement is repeated within REANNOUNCE_S.
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def leave(self, timeout_ms: int = LEAVE_TIMEOUT_MS) -> list[T]:
        """Stop taking work. Returns what the dispatcher had already sent: finish it."""
        self._send(self._enc.encode(WorkerLeaving(self.name)))
        got: list[T] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.acked and (left := deadline - time.monotonic()) > 0:
            if self._poller.poll(int(left * 1000) + 1):
                msg = self._decode(self._sock.recv())
                if msg is not None:
                    got.append(msg)
        if not self.acked:
            log.warning("no LeaveAck within %d ms (is the gateway gone?); leaving anyway", timeout_ms)
        return got

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncWorkChannel(_WorkerSide[T]):
    """The asyncio twin of WorkChannel (test fakes, async workers)."""

    def __init__(self, addr: str, msg_type: Any, name: str, ctx: zmq.asyncio.Context | None = None) -> None:
        super().__init__(msg_type, name)
        self._sock = make_socket(
            ctx or zmq.asyncio.Context.instance(), zmq.DEALER, addr, False, {zmq.ROUTING_ID: self.identity}
        )

    def _send(self, data: bytes) -> None:
        fut = self._sock.send(data, zmq.NOBLOCK)  # resolves at once; dropped if no dispatcher
        if fut.done() and fut.exception() is not None and not isinstance(fut.exception(), zmq.Again):
            raise fut.exception()  # type: ignore[misc]

    async def recv(self) -> T:
        while True:
            if self._ready_due():
                self._send(self._ready())
            try:
                data = await asyncio.wait_for(self._sock.recv(), REANNOUNCE_S)
            except asyncio.TimeoutError:
                continue
            msg = self._decode(data)
            if msg is not None:
                return msg

    async def leave(self, timeout_s: float = LEAVE_TIMEOUT_MS / 1000) -> list[T]:
        self._send(self._enc.encode(WorkerLeaving(self.name)))
        got: list[T] = []
        deadline = time.monotonic() + timeout_s
        while not self.acked and (left := deadline - time.monotonic()) > 0:
            try:
                msg = self._decode(await asyncio.wait_for(self._sock.recv(), left))
            except asyncio.TimeoutError:
                break
            if msg is not None:
                got.append(msg)
        return got

    def close(self) -> None:
        self._sock.close(linger=0)


class CreditWorkChannel(_WorkerSide[T]):
    """Worker side for a worker that takes several messages at once (the gpu_worker): `offer(n)`
    says it can take n more (sent when n or the messages received change, and every REANNOUNCE_S),
    `drain()` returns whatever arrived. Messages of the `uncounted` types (broadcast Aborts) arrive
    on the same socket without counting against the credit."""

    def __init__(
        self,
        addr: str,
        msg_type: Any,
        name: str,
        uncounted: tuple[type, ...] = (),
        ctx: zmq.Context | None = None,
    ) -> None:
        super().__init__(msg_type, name, uncounted)
        self._sock = make_socket(
            ctx or zmq.Context.instance(), zmq.DEALER, addr, False, {zmq.ROUTING_ID: self.identity}
        )
        self._offered: tuple[int, int] | None = None  # (seq, credits) last announced

    def offer(self, credits: int) -> None:
        credits = max(0, credits)
        if self._offered != (self._seq, credits) or self._ready_due():
            self._offered = (self._seq, credits)
            try:
                self._sock.send(self._ready(credits), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no dispatcher yet: repeated within REANNOUNCE_S

    def drain(self, timeout_ms: int = 0) -> list[T]:
        """Everything waiting; blocks up to `timeout_ms` for the first message."""
        out: list[T] = []
        if timeout_ms > 0 and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return out
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self._decode(data)
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        self._sock.close(linger=0)
