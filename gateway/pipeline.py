"""The gateway's pipeline client: the sockets to the workers, the registry of requests in flight,
and what the workers report (process status, the model's spec).

It pushes each validated request to the tokenizer pool, and one background task drains the inbox
(`AudioChunks`, `RequestError`, `ProcStatus`, `Prompt`, `ModelSpec`) into per-request asyncio queues
that the HTTP handlers read (through `gateway.synthesis`). It knows nothing of HTTP routes: the
handlers (`gateway.server`, `gateway.openai`, `gateway.openapi`) import it, never the reverse.

Model facts: the tokenizer workers announce the served model's `ModelSpec` (voices, options, sample
rate, token budget, prompt overhead…) when they are ready and again every few seconds. Until one
has, requests are answered with 503 (`model_spec`); /health and /ready answer as always.

Prompts: the tokenizer pool sends each built prompt back to the gateway inbox, and the gateway hands
it to a gpu_worker with free capacity (`common.pool` with credits: each gpu_worker announces its free
slots on `gpu_in`), so several gpu_workers (one per GPU, each with its codec_worker) share this
gateway and tokenizer pool, and a full worker is never sent a prompt to queue.

Cancellation: a request that ends for any reason other than the workers finishing it (client gone,
idle timeout, shutdown) is aborted: a prompt still waiting here for a free gpu_worker is dropped, one
that arrives later is dropped on arrival, and an Abort goes to every gpu_worker (the one holding the
request frees its KV pages; the others keep a bounded tombstone), so no KV pages stay held by a dead
request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from common.config import ServeConfig, check_model_settings
from common.ipc import Addresses, AsyncPullChannel, publish_stage
from common.late_imports import LateImports, describe
from common.messages import (
    Abort,
    AppendedText,
    AudioChunks,
    EncodeReply,
    GatewayInMsg,
    GenerateRequest,
    GpuInMsg,
    ModelSpec,
    ProcStatus,
    Prompt,
    PromptSize,
    RequestError,
)
from common.pool import AsyncDispatchChannel
from gateway.admission import Admission
from gateway.appending import TextRouter
from gateway.events import ClientGone, Event, Failed, Pending, Sized, error_status, finished_event
from gateway.metrics import GatewayMetrics
from gateway.procs import ProcessTable
from gateway.references import References
from gateway.segments import MAX_TEXT_CHARS_LIMIT
from gateway.timeouts import within
from gateway.voices import VoiceStore

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0  # no event for this long → 504 and Abort: nothing hangs forever
WATCH_INTERVAL_S = 0.2  # how often the gateway looks for processes that died
SUBMIT_TIMEOUT_S = 30.0  # no tokenizer worker connected for this long → 503
# Building a prompt is idempotent: one whose tokenizer worker died is handed to another (or to the
# restarted one), up to this many tries in all; a text that kills every worker it meets then fails.
PROMPT_TRIES = 3
SPEC_RETRY_AFTER_S = 1  # the tokenizer workers announce the model's spec every second
# The most requests a free tokenizer worker is handed at once where more wait than workers are free
# (common.pool: runs): a burst of 384 at one worker then costs ~48 round trips instead of 384.
TOKENIZER_RUN = 8
DISCONNECT_POLL_S = 1.0  # how often a waiting handler checks that its client is still there
_RID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")
# The gateway's own ids for a request's parts (its text segments, its sizing) are
# `<request id>/<part>`: clients may not use "/" in X-Request-Id, so no part's id is ever a client's.
PART_SEP = "/"
# The key under which a web.Request holds the id it claimed (a typed key where aiohttp has them).
_CLAIM: Any = (
    web.RequestKey("voxpipe_request_id", str) if hasattr(web, "RequestKey") else "voxpipe_request_id"
)


class Pipeline:
    """Sockets, per-request queues, the process table, the metrics and the model's spec, shared by
    the HTTP handlers (`gateway.server`, `gateway.openai`, `gateway.openapi`)."""

    def __init__(
        self,
        cfg: ServeConfig,
        addresses: Addresses,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        submit_timeout_s: float = SUBMIT_TIMEOUT_S,
    ) -> None:
        self.cfg = cfg
        self.addresses = addresses
        self.spec: ModelSpec | None = None  # announced by the tokenizer workers (see learn)
        self.spec_error = ""  # why an announced spec cannot be served with these settings
        self.idle_timeout_s = idle_timeout_s
        self.submit_timeout_s = submit_timeout_s
        self.procs = ProcessTable(
            cfg.tokenizer.workers,
            gpu_workers=cfg.gpu_workers,
            heartbeat_timeout_s=cfg.gateway.heartbeat_timeout,
        )
        self.admission = Admission(self._stream_capacity, cfg.gateway.max_queue, cfg.gateway.queue_timeout)
        self.metrics = GatewayMetrics(self.procs, self.admission)
        # Clips to encode go to the ready codec_workers (gateway.references); saved voices by name.
        # (A pipeline built without addresses, to check settings, never sends one.)
        codec_in = addresses.codec_in if addresses is not None else ""
        self.references = References(codec_in, cfg, lambda: self.procs.ready_names("codec_worker"))
        self.voices = VoiceStore(cfg.gateway.voices_dir)
        self.created = int(time.time())
        self.closing = False  # set on shutdown: no new segments are submitted
        self._pending: dict[str, Pending] = {}
        self.metrics.watch_registry(lambda: len(self._pending))
        # Request ids claimed by HTTP requests, from their arrival (before the body is read) until
        # their handler returns: an id is unique among requests in flight whatever their stage.
        self._claimed: dict[str, web.Request] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # background sends, kept so they are not GC'd
        self._inbox_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._send_to_tokenizers: AsyncDispatchChannel[GenerateRequest] | None = None
        self._send_to_gpu: AsyncDispatchChannel[GpuInMsg] | None = None
        self._routing: dict[str, asyncio.Task[Any]] = {}  # rid → prompt waiting for a gpu_worker
        self._holder: dict[str, str] = {}  # rid → the process holding it (tokenizer, then gpu_worker)
        # rid → (its request, tries so far) from its submission until a tokenizer worker answers it:
        # what a dead worker's requests are built again from; an answer for a rid not here is late.
        self._building: dict[str, tuple[GenerateRequest, int]] = {}
        self._recv_from_workers: AsyncPullChannel[GatewayInMsg] | None = None
        # Appended text of open requests (native input streaming): to tokenize, then to their gpu_worker.
        self.appends = TextRouter(
            lambda: self._send_to_tokenizers, lambda: self._send_to_gpu, submit_timeout_s
        )
        if cfg.gateway.max_text_chars > MAX_TEXT_CHARS_LIMIT:
            log.warning(
                "--max-text-chars %d is above the gateway's limit; texts are capped at %d characters",
                cfg.gateway.max_text_chars,
                MAX_TEXT_CHARS_LIMIT,
            )

    # -- lifecycle (aiohttp signals) -------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        a = self.addresses
        self._send_to_tokenizers = AsyncDispatchChannel(a.requests, bind=True, burst=TOKENIZER_RUN)
        self._send_to_tokenizers.start()  # read announcements now: a bad one is dropped, not left queued
        # A gpu_worker this gateway meets for the first time holds nothing of ours: whatever it runs
        # is a previous gateway's (restarted by the supervisor), so it is told to drop it.
        self._send_to_gpu = AsyncDispatchChannel(
            a.gpu_in, bind=True, greeting=Abort(rids=[], everything=True)
        )
        self._send_to_gpu.start()  # gpu_workers register before the first prompt (aborts reach them)
        self._recv_from_workers = AsyncPullChannel(a.gateway_in, GatewayInMsg, bind=True)
        self._inbox_task = asyncio.create_task(self._inbox_loop(), name="gateway-inbox")
        self._watch_task = asyncio.create_task(self._watch_processes(), name="gateway-watch")
        self._lag_task = asyncio.create_task(self.metrics.loop_lag.run(), name="gateway-loop-lag")
        model = self.cfg.model or "the default model"
        log.info("gateway for %s: requests → %s, inbox ← %s", model, a.requests, a.gateway_in)

    # -- the model's spec ------------------------------------------------------------------------

    def learn(self, spec: ModelSpec) -> None:
        """Take the model's spec as a tokenizer worker announced it. Raises ValueError for settings
        the model cannot honour (as `voxpipe serve` does at startup, for a gateway run alone)."""
        if self.cfg.model and spec.name.lower() != self.cfg.model.lower():  # "": whatever is served
            raise ValueError(
                f"a tokenizer worker serves {spec.name}, this gateway {self.cfg.model}: check --model"
            )
        check_model_settings(self.cfg, msgspec.structs.asdict(spec))
        if spec != self.spec:  # announcements repeat: the object stays the same while its facts do
            log.info("model spec of %s: %d voices, %d Hz", spec.name, len(spec.voices), spec.sample_rate)
            self.spec = spec
        self.spec_error = ""

    def model_spec(self) -> ModelSpec | Failed:
        """The served model's spec, or a Failed(503) saying why there is none yet."""
        if self.spec is not None:
            return self.spec
        if self.spec_error:
            return Failed(503, f"the model cannot be served with these settings: {self.spec_error}")
        return Failed(
            503,
            "no tokenizer worker has announced the model yet (the workers are starting); retry, see /ready",
        )

    def spec_retry(self) -> dict[str, str]:
        """Retry-After for a 503 while no tokenizer worker has announced the model (they announce
        every second: a restarted gateway learns it that soon); none when the settings refuse it."""
        return {} if self.spec is not None or self.spec_error else {"Retry-After": str(SPEC_RETRY_AFTER_S)}

    @property
    def sample_rate(self) -> int:
        assert self.spec is not None, "the sample rate is known once the spec is"
        return self.spec.sample_rate

    async def shutdown(self, app: web.Application) -> None:
        """Fail what is in flight (its handlers then return at once) and abort it upstream."""
        self.closing = True
        rids = list(self._pending)
        if rids:
            log.info("shutting down with %d requests in flight; aborting them", len(rids))
            for rid in rids:  # their handlers see an upstream end, so they send no Abort of their own
                self._pending[rid].queue.put_nowait(Failed(503, "the gateway is shutting down; retry"))
            self.abort(rids)

    def _stream_capacity(self) -> float | None:
        if self.cfg.gateway.max_streams > 0:
            return float(self.cfg.gateway.max_streams)
        return self.procs.stream_capacity()

    async def _watch_processes(self) -> None:
        """Every request a process held when it died ends now with an explicit 503 (a stream is
        broken, a whole response is a JSON error), instead of waiting out the idle timeout. Also
        says which modules the gateway imported while serving (common/late_imports.py)."""
        late = LateImports()  # what startup loaded: an import from here on holds every stream
        while not self.closing:
            await asyncio.sleep(WATCH_INTERVAL_S)
            imported = late.check()
            if imported:
                log.warning("imported while serving %s: import them at startup", describe(imported))
            for name in self.procs.newly_dead():
                self._fail_held_by(name)
            self.admission.pump()  # capacity grows when a gpu_worker reports

    def _fail_held_by(self, name: str) -> None:
        # A codec_worker's requests are those its gpu_worker (same suffix) was given.
        holders = {name, name.replace("codec_worker", "gpu_worker", 1)}
        rids = [rid for rid, holder in self._holder.items() if holder in holders and rid in self._pending]
        if name.startswith("codec_worker"):
            self.references.fail_worker(name)  # the clips it was encoding
        if name.startswith("tokenizer_worker"):
            self.appends.worker_died(name)  # the appended text it was tokenizing
            rids = self._build_again(name, rids)
        if not rids:
            return
        log.error("%s stopped; failing the %d requests it held", name, len(rids))
        for rid in rids:
            self._put(rid, Failed(503, f"{name} stopped while handling this request; retry"))
        if rids and not name.startswith("tokenizer_worker"):
            self.abort(rids)  # a dead codec's gpu_worker may still be generating for them

    def _build_again(self, name: str, rids: list[str]) -> list[str]:
        """Hand the prompts a dead tokenizer worker was building to the pool again (ahead of new
        requests); returns the rids that are out of tries, to fail."""
        out = []
        for rid in rids:
            req, tries = self._building.get(rid, (None, PROMPT_TRIES))
            if req is None or tries >= PROMPT_TRIES:
                out.append(rid)
                continue
            log.warning("[%s] %s stopped while building its prompt; building it again", rid, name)
            self._holder.pop(rid, None)
            task = asyncio.create_task(self._resubmit(req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return out

    async def _resubmit(self, req: GenerateRequest) -> None:
        failed = await self.submit(msgspec.structs.replace(req, urgent=True))
        if failed is not None:
            self._put(req.rid, failed)

    async def stop(self, app: web.Application) -> None:
        for task in (self._inbox_task, self._watch_task, self._lag_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        for chan in (self._send_to_tokenizers, self._send_to_gpu):
            if chan is not None:
                await chan.aclose()
        if self._recv_from_workers is not None:
            self._recv_from_workers.close()
        self.references.close()

    # -- inbox -----------------------------------------------------------------------------------

    async def _inbox_loop(self) -> None:
        assert self._recv_from_workers is not None
        while True:
            for msg in await self._recv_from_workers.recv_batch():
                try:
                    self.dispatch(msg)
                except Exception:
                    log.exception("failed to handle %s from a worker", type(msg).__name__)

    def dispatch(self, msg: GatewayInMsg) -> None:
        match msg:
            case AudioChunks(chunks=chunks, finished=finished):
                for chunk in chunks:
                    if chunk.pcm:  # empty = a window the codec dropped (invalid codes)
                        self._put(chunk.rid, chunk.pcm)
                for fin in finished:
                    self._put(fin.rid, finished_event(fin))
            case RequestError(rid=rid, status=status, message=message):
                self._building.pop(rid, None)
                self._put(rid, Failed(error_status(status), message))
            case ProcStatus(name=name):
                # A restart noticed here, in inbox order, fails only what the old instance held:
                # nothing can have been routed to the new one before its first status.
                if self.procs.update(msg):
                    self._fail_held_by(name)
            case Prompt(rid=rid):
                if self._built(rid):
                    self._route(msg)
            case PromptSize(rid=rid, rows=rows):
                if self._built(rid):
                    self._put(rid, Sized(rows))
            case EncodeReply():
                self.references.resolve(msg)
            case AppendedText():
                self.appends.took(msg)
            case ModelSpec():
                try:
                    self.learn(msg)
                except ValueError as e:
                    if self.spec_error != str(e):
                        log.error("cannot serve the announced model: %s", e)
                    self.spec_error = str(e)
            case _:
                raise TypeError(f"unexpected message type {type(msg).__name__} on the gateway inbox")

    def _built(self, rid: str) -> bool:
        """A tokenizer worker answered `rid`: True for the first answer, False for a second one (a
        dead worker's prompt that was on its way when it was built again) or a stranger's."""
        if self._building.pop(rid, None) is None:
            log.debug("[%s] dropped a prompt that was already built, or never asked for", rid)
            return False
        return True

    def _route(self, prompt: Prompt) -> None:
        """Hand a built prompt to a gpu_worker with free capacity (waits here while all are full)."""
        if prompt.rid not in self._pending or prompt.rid in self._routing:
            log.debug("[%s] dropped a prompt for a request that is gone", prompt.rid)
            return
        bad = self._inconsistent(prompt)
        if bad:
            log.error("[%s] dropped an inconsistent prompt from a tokenizer worker: %s", prompt.rid, bad)
            self._put(prompt.rid, Failed(500, f"the prompt builder sent an inconsistent prompt ({bad})"))
            return
        assert self._send_to_gpu is not None
        task = asyncio.create_task(self._send_to_gpu.send(prompt, urgent=prompt.urgent))
        self._routing[prompt.rid] = task
        task.add_done_callback(lambda t, rid=prompt.rid: self._routed(rid, t))

    def _inconsistent(self, prompt: Prompt) -> str:
        """Why a prompt's bytes do not add up ("" when they do): a gpu_worker is never handed a
        prompt it cannot even read."""
        if self.spec is None:
            return "no model spec to check it against"
        return prompt.shape_error(self.spec.n_codebooks)

    def _routed(self, rid: str, task: asyncio.Task[Any]) -> None:
        if self._routing.get(rid) is task:
            del self._routing[rid]
        if task.cancelled():
            return
        if task.exception() is not None:
            self._put(rid, Failed(503, f"could not hand the prompt to a gpu_worker: {task.exception()}"))
        elif rid in self._pending:
            assert self._send_to_gpu is not None
            self._holder[rid] = self._send_to_gpu.workers.get(task.result(), "")
            self.appends.routed(rid, task.result())

    def _put(self, rid: str, event: Event) -> None:
        pending = self._pending.get(rid)
        if pending is not None:  # else the request is already gone (aborted, timed out): late news
            pending.queue.put_nowait(event)

    # -- what a synthesis uses -------------------------------------------------------------------

    def register(self, rid: str) -> Pending:
        """Start routing `rid`'s events to a new queue (before submitting, so none is missed)."""
        pending = self._pending[rid] = Pending()
        return pending

    def release(self, rid: str) -> None:
        self.appends.forget(rid)
        self._holder.pop(rid, None)
        self._building.pop(rid, None)
        if self._pending.pop(rid, None) is not None:
            publish_stage(rid, "response_done")

    def request_id(self, request: web.Request) -> tuple[str, str | None]:
        """(rid, why it cannot be used): the client's X-Request-Id when valid, else a new one; an
        id already in flight is refused, for each endpoint to answer in its own error shape. A
        usable id is claimed by `request` until `unclaim(request)` (the server's middleware calls
        it when the handler returns), so a second request with the id gets the refusal even while
        the first is still sending its body."""
        rid = client_request_id(request) or uuid.uuid4().hex
        if rid in self._pending or rid in self._claimed:
            return rid, f"request id {rid} is already in flight; send a unique X-Request-Id"
        self._claimed[rid] = request
        request[_CLAIM] = rid
        return rid, None

    def unclaim(self, request: web.Request) -> None:
        """Give back the request id `request` claimed, if any."""
        rid = request.get(_CLAIM)
        if rid is not None and self._claimed.get(rid) is request:
            del self._claimed[rid]

    async def submit(self, req: GenerateRequest) -> Failed | None:
        """Hand `req` to the tokenizer pool; a Failed(503) when no worker takes it in time."""
        assert self._send_to_tokenizers is not None
        if req.rid in self._pending:  # recorded before the send: the answer may come first
            self._building[req.rid] = (req, self._building.get(req.rid, (req, 0))[1] + 1)
        try:
            send = self._send_to_tokenizers.send(req, urgent=req.urgent)
            ident = await within(send, self.submit_timeout_s)
            name = self._send_to_tokenizers.workers.get(ident, "")
            if req.rid in self._pending:
                self._holder.setdefault(req.rid, name)
                # Handed over as it died: where its death was seen already, the requests it held
                # were failed without this one; otherwise the watch fails them all when it sees it.
                if self.procs.seen_dead(name):
                    self._fail_held_by(name)
        except asyncio.TimeoutError:
            return Failed(
                503, f"no tokenizer worker took the request within {self.submit_timeout_s:g} s; see /ready"
            )
        log.debug("[%s] submitted: %d chars", req.rid, len(req.text))
        return None

    def abort(self, rids: list[str]) -> None:
        """Drop these requests: a prompt still waiting for a free gpu_worker is never sent, and every
        gpu_worker is told to free their KV pages (this runs in handlers' `finally`, also when they
        are being cancelled, so it never waits: sends that cannot go at once are dropped)."""
        for rid in rids:
            task = self._routing.pop(rid, None)
            if task is not None and not task.done():
                task.cancel()
        assert self._send_to_gpu is not None
        try:
            n = self._send_to_gpu.broadcast(Abort(rids=rids))
            log.info("aborted %s (told %d gpu_workers)", ", ".join(rids), n)
        except Exception:
            log.exception("could not send Abort for %s", ", ".join(rids))

    async def next_event(self, request: web.Request, pending: Pending) -> Event:
        """The request's next event, or `Failed(504)` after `idle_timeout_s` without one.

        Raises ClientGone when the client disconnects while we wait. aiohttp's handler
        cancellation (on in `main` and in test servers) also covers that; polling the transport
        keeps it true under any runner.
        """
        if not pending.queue.empty():  # a chunk queued already: taken without arming a timer
            event = pending.queue.get_nowait()
            pending.ended_upstream = not isinstance(event, bytes)
            return event
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pending.ended_upstream = False  # the workers may still be at it: abort
                return Failed(
                    504, f"no progress from the workers for {self.idle_timeout_s:g} s; request aborted"
                )
            try:
                event = await within(pending.queue.get(), min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ClientGone from None
                continue
            pending.ended_upstream = not isinstance(event, bytes)
            return event


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id when it is 1-64 of [A-Za-z0-9._:-] (so `voxpipe tap --rid` can
    follow a request its client names), else None: the gateway makes one. "/" is not among them:
    the gateway's ids for a request's parts use it (`PART_SEP`)."""
    rid = request.headers.get("X-Request-Id", "")
    return rid if 0 < len(rid) <= 64 and set(rid) <= _RID_CHARS else None
