"""The gateway: aiohttp HTTP API in front of the worker pipeline.

One `Gateway` per process. It pushes each validated request to the tokenizer pool, and one
background task drains the inbox (`AudioChunks`, `RequestError`, `ProcStatus`) into per-request
asyncio queues that the HTTP handlers read. A handler waits for its request's first event before
sending headers, so errors found upstream (a prompt that is too long) still get a proper status.

Cancellation: a request that ends for any reason other than the workers finishing it (client gone,
idle timeout, shutdown) is aborted on the gpu_worker, so no KV pages stay held by a dead request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from common.config import ServeConfig
from common.ipc import Addresses, AsyncPullChannel, AsyncPushChannel
from common.messages import (
    Abort,
    AudioChunks,
    FinishReason,
    GatewayInMsg,
    GenerateRequest,
    ProcStatus,
    RequestError,
)
from gateway.body import MAX_BODY_BYTES, BodyError, read_fields
from gateway.events import ClientGone, Done, Event, Failed, Pending, error_status, finished_event
from gateway.procs import ProcessTable
from gateway.validation import BadRequest, parse_generate
from gateway.wav import wav_file, wav_header
from programs import get_spec

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0  # no event for this long → 504 and Abort: nothing hangs forever
SUBMIT_TIMEOUT_S = 30.0  # no tokenizer worker connected for this long → 503
DISCONNECT_POLL_S = 1.0  # how often a waiting handler checks that its client is still there


class Gateway:
    """Sockets, per-request queues and the process table, shared by the HTTP handlers."""

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
        self.sample_rate = int(self.spec["sample_rate"])
        self.idle_timeout_s = idle_timeout_s
        self.submit_timeout_s = submit_timeout_s
        self.procs = ProcessTable(cfg.tokenizer_workers)
        self._pending: dict[str, Pending] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # background sends, kept so they are not GC'd
        self._inbox_task: asyncio.Task[None] | None = None
        self._send_to_tokenizers: AsyncPushChannel[GenerateRequest] | None = None
        self._send_to_gpu: AsyncPushChannel[Abort] | None = None
        self._recv_from_workers: AsyncPullChannel[GatewayInMsg] | None = None

    # -- lifecycle (aiohttp signals) -------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        a = self.addresses
        self._send_to_tokenizers = AsyncPushChannel(a.requests, bind=True)
        self._send_to_gpu = AsyncPushChannel(a.gpu_in, bind=False)
        self._recv_from_workers = AsyncPullChannel(a.gateway_in, GatewayInMsg, bind=True)
        self._inbox_task = asyncio.create_task(self._inbox_loop(), name="gateway-inbox")
        log.info("gateway for %s: requests → %s, inbox ← %s", self.cfg.model, a.requests, a.gateway_in)

    async def shutdown(self, app: web.Application) -> None:
        """Fail what is in flight (its handlers then return at once) and abort it upstream."""
        rids = list(self._pending)
        if rids:
            log.info("shutting down with %d requests in flight; aborting them", len(rids))
            for rid in rids:  # their handlers see an upstream end, so they send no Abort of their own
                self._pending[rid].queue.put_nowait(Failed(503, "the gateway is shutting down; retry"))
            self._spawn(self._send_abort(rids))

    async def stop(self, app: web.Application) -> None:
        if self._inbox_task is not None:
            self._inbox_task.cancel()
            await asyncio.gather(self._inbox_task, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        for chan in (self._send_to_tokenizers, self._send_to_gpu, self._recv_from_workers):
            if chan is not None:
                chan.close()

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
            case ProcStatus():
                self.procs.update(msg)
            case _:
                raise TypeError(f"unexpected message type {type(msg).__name__} on the gateway inbox")

    def _put(self, rid: str, event: Event) -> None:
        pending = self._pending.get(rid)
        if pending is not None:  # else the request is already gone (aborted, timed out): late news
            pending.queue.put_nowait(event)

    # -- helpers for handlers --------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_abort(self, rids: list[str]) -> None:
        assert self._send_to_gpu is not None
        try:
            await self._send_to_gpu.send(Abort(rids=rids))
            log.info("aborted %s", ", ".join(rids))
        except Exception:
            log.exception("could not send Abort for %s", ", ".join(rids))

    async def _next_event(self, request: web.Request, pending: Pending) -> Event:
        """The request's next event, or `Failed(504)` after `idle_timeout_s` without one.

        Raises ClientGone when the client disconnects while we wait. aiohttp's handler
        cancellation (on in `main` and in test servers) also covers that; polling the transport
        keeps it true under any runner.
        """
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
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
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        try:
            params = parse_generate(await read_fields(request), self.spec, self.cfg)
        except BodyError as e:
            return _error(e.status, e.message, headers)
        except BadRequest as e:
            return _error(400, str(e), headers)
        except ConnectionError:
            raise  # the client went away while sending its body; nothing to answer
        except Exception:
            log.exception("[%s] failed to read the request", rid)
            return _error(500, "internal error while reading the request", headers)

        pending = self._pending[rid] = Pending()
        try:
            req = GenerateRequest(
                rid=rid,
                text=params.text,
                sampling=params.sampling,
                model_kwargs={"voice": params.voice},
                arrival=time.time(),
            )
            assert self._send_to_tokenizers is not None
            try:
                await asyncio.wait_for(self._send_to_tokenizers.send(req), self.submit_timeout_s)
            except asyncio.TimeoutError:
                return _error(
                    503,
                    f"no tokenizer worker took the request within {self.submit_timeout_s:g} s; see /ready",
                    headers,
                )
            log.debug("[%s] submitted: %d chars, voice %s", rid, len(params.text), params.voice)

            first = await self._next_event(request, pending)
            if isinstance(first, Failed):
                log.info("[%s] failed before audio: %d %s", rid, first.status, first.message)
                return _error(first.status, first.message, headers)
            if first == Done(FinishReason.ABORT):
                return _error(
                    503, "the request was cancelled by the workers before any audio; retry", headers
                )
            if params.streaming:
                return await self._stream(request, rid, first, pending, headers)
            return await self._collect(request, rid, first, pending, headers)
        except asyncio.CancelledError:
            log.info("[%s] client disconnected", rid)  # aiohttp cancels the handler when it notices
            raise
        except ClientGone:
            log.info("[%s] client disconnected", rid)
            # Nobody reads this; 499 ("client closed request", as nginx logs it) is for the access log.
            return web.Response(status=499, headers=headers)
        finally:
            # Also runs when aiohttp cancels the handler because the client disconnected.
            del self._pending[rid]
            if not pending.ended_upstream:
                self._spawn(self._send_abort([rid]))

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        event: Event,
        pending: Pending,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Chunked WAV: an open-ended header, then PCM as it arrives."""
        resp = web.StreamResponse(
            status=200, headers={**headers, "Content-Type": "audio/wav", "Cache-Control": "no-store"}
        )
        n_bytes = 0
        try:
            await resp.prepare(request)  # no Content-Length: aiohttp sends it chunked (HTTP/1.1)
            header = wav_header(self.sample_rate, None)  # sent with the first audio: one write fewer
            while isinstance(event, bytes):
                await resp.write(header + event)
                n_bytes += len(event)
                header = b""
                event = await self._next_event(request, pending)
            if header:
                await resp.write(header)
            if event in (Done(FinishReason.STOP), Done(FinishReason.LENGTH)):
                await resp.write_eof()
                log.info("[%s] streamed %.2f s of audio", rid, n_bytes / 2 / self.sample_rate)
                return resp
        except (ConnectionError, ClientGone):
            # The client went away; returning the prepared response lets aiohttp finish quietly.
            log.info("[%s] client disconnected after %d audio bytes", rid, n_bytes)
            return resp
        why = event.message if isinstance(event, Failed) else "cancelled by the workers"
        log.warning("[%s] failed after %d audio bytes: %s; breaking the stream", rid, n_bytes, why)
        _break_stream(request)
        return resp

    async def _collect(
        self,
        request: web.Request,
        rid: str,
        event: Event,
        pending: Pending,
        headers: dict[str, str],
    ) -> web.Response:
        """Non-streaming: gather every chunk, answer one complete WAV (or a JSON error)."""
        parts: list[bytes] = []
        while isinstance(event, bytes):
            parts.append(event)
            event = await self._next_event(request, pending)
        if isinstance(event, Failed):
            log.info("[%s] failed: %d %s", rid, event.status, event.message)
            return _error(event.status, event.message, headers)
        if event.reason == FinishReason.ABORT:
            return _error(503, "the request was cancelled by the workers before it finished; retry", headers)
        body = wav_file(self.sample_rate, b"".join(parts))
        log.info("[%s] returning %.2f s of audio", rid, (len(body) - 44) / 2 / self.sample_rate)
        return web.Response(body=body, headers={**headers, "Content-Type": "audio/wav"})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        ready, rows = self.procs.report()
        body = {"ready": ready, "model": self.cfg.model, "processes": rows}
        return web.json_response(body, status=200 if ready else 503)


def _break_stream(request: web.Request) -> None:
    """End a chunked response without its terminating chunk, so the client sees a broken
    transfer instead of a short file that looks complete. close() (not abort()) flushes the
    audio already written; aiohttp's later write_eof then fails quietly on the closed transport."""
    if request.transport is not None:
        request.transport.close()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413 outside a handler) and anything a handler let slip,
    as JSON like the rest of the API."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"no such endpoint {request.path}; endpoints: POST /generate, GET /health, GET /ready"
        elif e.status == 405:
            message = f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(_allowed(e)))}"
        else:
            message = e.text or e.reason
        return _error(e.status, message)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
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
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app[GATEWAY] = gateway
    app.router.add_post("/generate", gateway.handle_generate)
    app.router.add_get("/health", gateway.handle_health)
    app.router.add_get("/ready", gateway.handle_ready)
    app.on_startup.append(gateway.start)
    app.on_shutdown.append(gateway.shutdown)
    app.on_cleanup.append(gateway.stop)
    return app
