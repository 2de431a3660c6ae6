"""The gateway: aiohttp HTTP API in front of the worker pipeline.

One `Gateway` per process. It pushes each validated request to the tokenizer pool, and one
background task drains the inbox (`AudioChunks`, `RequestError`, `ProcStatus`) into per-request
asyncio queues that the HTTP handlers read (through `gateway.synthesis`, which also splits long
texts into segments, and `gateway.respond`, which encodes and frames the audio).

Endpoints: `POST /generate` (here), `POST /v1/audio/speech` and `GET /v1/models` (OpenAI's API, in
`gateway.openai`), `GET /openapi.json` (`gateway.openapi`), `GET /metrics` (Prometheus),
`GET /health`, `GET /ready`.

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

from aiohttp import web

from common.config import ServeConfig, check_model_settings
from common.ipc import Addresses, AsyncPullChannel, publish_stage
from common.messages import (
    Abort,
    AudioChunks,
    GatewayInMsg,
    GenerateRequest,
    GpuInMsg,
    ProcStatus,
    Prompt,
    RequestError,
)
from common.pool import AsyncDispatchChannel
from gateway import auth, openai, openapi
from gateway.admission import Admission
from gateway.body import MAX_BODY_BYTES, BodyError, read_fields
from gateway.encoders import WavEncoder
from gateway.events import ClientGone, Event, Failed, Pending, error_status, finished_event
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, outcome_of
from gateway.procs import ProcessTable
from gateway.respond import client_request_id, error_body, speak
from gateway.segments import MAX_TEXT_CHARS_LIMIT
from gateway.validation import BadRequest, parse_generate
from programs import get_spec

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0  # no event for this long → 504 and Abort: nothing hangs forever
WATCH_INTERVAL_S = 0.2  # how often the gateway looks for processes that died
SUBMIT_TIMEOUT_S = 30.0  # no tokenizer worker connected for this long → 503
DISCONNECT_POLL_S = 1.0  # how often a waiting handler checks that its client is still there
ENDPOINTS = "POST /generate, POST /v1/audio/speech, GET /v1/models, GET /openapi.json, GET /metrics, GET /health, GET /ready"


class Gateway:
    """Sockets, per-request queues, the process table and the metrics, shared by the handlers."""

    def __init__(
        self,
        cfg: ServeConfig,
        addresses: Addresses,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        submit_timeout_s: float = SUBMIT_TIMEOUT_S,
    ) -> None:
        self.cfg = cfg
        self.addresses = addresses
        self.spec = get_spec(cfg.model)
        check_model_settings(cfg, self.spec)  # as `voxpipe serve` does, for a gateway run alone
        self.sample_rate = int(self.spec["sample_rate"])
        self.idle_timeout_s = idle_timeout_s
        self.submit_timeout_s = submit_timeout_s
        self.procs = ProcessTable(cfg.tokenizer.workers, gpu_workers=cfg.gpu_workers)
        self.admission = Admission(self._stream_capacity, cfg.gateway.max_queue, cfg.gateway.queue_timeout)
        self.metrics = GatewayMetrics(self.procs, self.admission)
        self.created = int(time.time())
        self.closing = False  # set on shutdown: no new segments are submitted
        self.requires_key = False  # an API key guards the HTTP API (gateway.auth)
        self._pending: dict[str, Pending] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # background sends, kept so they are not GC'd
        self._inbox_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._send_to_tokenizers: AsyncDispatchChannel[GenerateRequest] | None = None
        self._send_to_gpu: AsyncDispatchChannel[GpuInMsg] | None = None
        self._routing: dict[str, asyncio.Task[Any]] = {}  # rid → prompt waiting for a gpu_worker
        self._holder: dict[str, str] = {}  # rid → the process holding it (tokenizer, then gpu_worker)
        self._recv_from_workers: AsyncPullChannel[GatewayInMsg] | None = None
        if cfg.gateway.max_text_chars > MAX_TEXT_CHARS_LIMIT:
            log.warning(
                "--max-text-chars %d is above the gateway's limit; texts are capped at %d characters",
                cfg.gateway.max_text_chars,
                MAX_TEXT_CHARS_LIMIT,
            )

    # -- lifecycle (aiohttp signals) -------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        a = self.addresses
        self._send_to_tokenizers = AsyncDispatchChannel(a.requests, bind=True)
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
        log.info("gateway for %s: requests → %s, inbox ← %s", self.cfg.model, a.requests, a.gateway_in)

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
        broken, a whole response is a JSON error), instead of waiting out the idle timeout."""
        while not self.closing:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name in self.procs.newly_dead():
                self._fail_held_by(name)
            self.admission.pump()  # capacity grows when a gpu_worker reports

    def _fail_held_by(self, name: str) -> None:
        # A codec_worker's requests are those its gpu_worker (same suffix) was given.
        holders = {name, name.replace("codec_worker", "gpu_worker", 1)}
        rids = [rid for rid, holder in self._holder.items() if holder in holders and rid in self._pending]
        log.error("%s stopped; failing the %d requests it held", name, len(rids))
        for rid in rids:
            self._put(rid, Failed(503, f"{name} stopped while handling this request; retry"))
        if rids and not name.startswith("tokenizer_worker"):
            self.abort(rids)  # a dead codec's gpu_worker may still be generating for them

    async def stop(self, app: web.Application) -> None:
        for task in (self._inbox_task, self._watch_task):
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

    # -- inbox -----------------------------------------------------------------------------------

    async def _inbox_loop(self) -> None:
        assert self._recv_from_workers is not None
        while True:
            msg = await self._recv_from_workers.recv()
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
                self._put(rid, Failed(error_status(status), message))
            case ProcStatus(name=name):
                # A restart noticed here, in inbox order, fails only what the old instance held:
                # nothing can have been routed to the new one before its first status.
                if self.procs.update(msg):
                    self._fail_held_by(name)
            case Prompt(rid=rid):
                self._route(msg)
            case _:
                raise TypeError(f"unexpected message type {type(msg).__name__} on the gateway inbox")

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
        """Why a prompt's shape does not add up ("" when it does): a gpu_worker is never handed a
        prompt it cannot even read."""
        n_codebooks = int(self.spec.get("n_codebooks", 1))
        if prompt.n_rows < 0 or len(prompt.tokens) != prompt.n_rows * n_codebooks * 4:
            return f"{len(prompt.tokens)} bytes for {prompt.n_rows} rows of {n_codebooks} int32 ids"
        return ""

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
        self._holder.pop(rid, None)
        if self._pending.pop(rid, None) is not None:
            publish_stage(rid, "response_done")

    def request_id(self, request: web.Request) -> tuple[str, str | None]:
        """(rid, why it cannot be used): the client's X-Request-Id when valid, else a new one; an
        id already in flight is refused, for each endpoint to answer in its own error shape."""
        rid = client_request_id(request) or uuid.uuid4().hex
        if rid in self._pending:
            return rid, f"request id {rid} is already in flight; send a unique X-Request-Id"
        return rid, None

    async def submit(self, req: GenerateRequest) -> Failed | None:
        """Hand `req` to the tokenizer pool; a Failed(503) when no worker takes it in time."""
        assert self._send_to_tokenizers is not None
        try:
            send = self._send_to_tokenizers.send(req, urgent=req.urgent)
            ident = await asyncio.wait_for(send, self.submit_timeout_s)
            if req.rid in self._pending:
                self._holder.setdefault(req.rid, self._send_to_tokenizers.workers.get(ident, ""))
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
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pending.ended_upstream = False  # the workers may still be at it: abort
                return Failed(
                    504, f"no progress from the workers for {self.idle_timeout_s:g} s; request aborted"
                )
            try:
                event = await asyncio.wait_for(pending.queue.get(), min(left, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ClientGone from None
                continue
            pending.ended_upstream = not isinstance(event, bytes)
            return event

    # -- HTTP handlers ---------------------------------------------------------------------------

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        rid, clash = self.request_id(request)
        headers = {"X-Request-Id": rid}
        if clash:
            return _error(409, clash, headers)
        try:
            params = parse_generate(await read_fields(request), self.spec, self.cfg)
        except (BodyError, BadRequest) as e:
            status = e.status
            self.metrics.finished("generate", outcome_of(status))
            return _error(status, str(e), headers)
        except ConnectionError:
            raise  # the client went away while sending its body; nothing to answer
        except Exception:
            log.exception("[%s] failed to read the request", rid)
            self.metrics.finished("generate", "server_error")
            return _error(500, "internal error while reading the request", headers)
        return await speak(
            self,
            request,
            rid,
            params,
            endpoint="generate",
            encoder=WavEncoder(self.sample_rate, params.streaming),
            mode="stream" if params.streaming else "whole",
            headers=headers,
            error=_error,
            started=started,
        )

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        ready, rows = self.procs.report()
        body = {"ready": ready, "model": self.cfg.model, "processes": rows}
        return web.json_response(body, status=200 if ready else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE  # has a version parameter: not content_type=
        return resp


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413 outside a handler) and anything a handler let slip,
    as JSON like the rest of the API (OpenAI's error shape under /v1/)."""
    openai_shape = request.path.startswith("/v1/")
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"no such endpoint {request.path}; endpoints: {ENDPOINTS}"
        elif e.status == 405:
            message = f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(_allowed(e)))}"
        else:
            message = e.text or e.reason
        if openai_shape:
            return web.json_response({"error": error_body(e.status, message)}, status=e.status)
        return _error(e.status, message)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        if openai_shape:
            return web.json_response({"error": error_body(500, "internal error")}, status=500)
        return _error(500, "internal error")


def _allowed(e: web.HTTPException) -> set[str]:
    return set(getattr(e, "allowed_methods", ()) or ())


GATEWAY = web.AppKey("gateway", Gateway)


def build_app(
    cfg: ServeConfig,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    submit_timeout_s: float = SUBMIT_TIMEOUT_S,
) -> web.Application:
    """The gateway's aiohttp app; sockets open on startup and close on cleanup. Run it with
    `handler_cancellation=True` so a client that disconnects cancels its handler at once."""
    if cfg.addresses is not None:
        addresses = cfg.addresses
    elif cfg.run_dir:
        addresses = Addresses.local(cfg.run_dir)
    else:
        raise ValueError(
            "ServeConfig has neither addresses nor run_dir; set one so the gateway can find the workers"
        )
    gateway = Gateway(cfg, addresses, idle_timeout_s=idle_timeout_s, submit_timeout_s=submit_timeout_s)
    middlewares = [_json_errors]
    key = auth.load_api_key(cfg)
    if key is not None:
        middlewares.append(auth.middleware(key, error_body))
        gateway.requires_key = True
        log.info("the HTTP API requires a Bearer key (except /health and /ready)")
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[GATEWAY] = gateway
    app.router.add_post("/generate", gateway.handle_generate)
    app.router.add_get("/health", gateway.handle_health)
    app.router.add_get("/ready", gateway.handle_ready)
    app.router.add_get("/metrics", gateway.handle_metrics)
    openai.add_routes(app, gateway)
    openapi.add_routes(app, gateway)
    app.on_startup.append(gateway.start)
    app.on_shutdown.append(gateway.shutdown)
    app.on_cleanup.append(gateway.stop)
    return app
