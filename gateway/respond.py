"""Answering a speech request: a `Synthesis` through an `Encoder`, as one of three responses.

- "stream": chunked bytes as they are encoded. A failure after audio went out breaks the transfer
  (no terminating chunk), so a client cannot take a truncated file for a complete one.
- "whole": one body with Content-Length once the audio is complete; a failure is a JSON error.
- "sse": `text/event-stream` of OpenAI's `speech.audio.delta` events (base64 of the encoded
  bytes) and a final `speech.audio.done` with token usage; a failure is an `error` event.

The handler waits for the first event before sending headers, so errors found upstream (a prompt
that is too long, no tokenizer worker) still get a proper status. `speak` also keeps the metrics:
requests in flight and each request's outcome.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from common.ipc import publish_stage
from gateway.encoders import Encoder
from gateway.events import ClientGone, Done, Event, Failed
from gateway.metrics import outcome_of
from gateway.pipeline import Pipeline
from gateway.synthesis import Synthesis
from gateway.timeouts import within
from gateway.validation import GenerateParams

log = logging.getLogger(__name__)

ErrorFn = Callable[[int, str, dict[str, str]], web.Response]

# libsndfile releases the GIL while it encodes, so a few threads spread mp3/opus work over cores.
_ENCODE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="encode")

ABORTED_BEFORE_AUDIO = "the request was cancelled by the workers before any audio; retry"
ABORTED_BEFORE_END = "the request was cancelled by the workers before it finished; retry"


class _Writer:
    """Writes a streamed response's bytes; a client that takes longer than `timeout_s` to take one
    write (it stopped reading: its socket's buffers and aiohttp's are full) is taken for gone, and
    its connection dropped, so that its stream's slot at admission comes back instead of waiting
    on it for good (`--send-timeout`)."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout_s: float) -> None:
        self.request, self.resp, self.timeout_s = request, resp, timeout_s

    async def write(self, data: bytes) -> None:
        await self._within(self.resp.write(data))

    async def write_eof(self) -> None:
        await self._within(self.resp.write_eof())

    async def _within(self, sending: Any) -> None:
        try:
            await within(sending, self.timeout_s)
        except asyncio.TimeoutError:
            log.info(
                "[%s] the client took no audio for %g s (--send-timeout); dropping it",
                self.resp.headers.get("X-Request-Id", ""),
                self.timeout_s,
            )
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ClientGone from None


class _Coder:
    """Runs an encoder's calls in order, off the event loop when it is CPU-heavy, and closes it
    only once no call is running: a handler cancelled mid-call must not free libsndfile's state
    under the thread still using it (the thread's own future says when it is done; the asyncio
    future wrapping it is cancelled with the handler)."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self._busy: concurrent.futures.Future[bytes] | None = None

    async def feed(self, pcm: bytes) -> bytes:
        return await self._run(self.encoder.feed, pcm)

    async def finish(self) -> bytes:
        return await self._run(self.encoder.finish)

    async def _run(self, fn: Callable[..., bytes], *args: Any) -> bytes:
        if not self.encoder.threaded:
            return fn(*args)
        self._busy = _ENCODE_POOL.submit(fn, *args)
        return await asyncio.wrap_future(self._busy)

    def close(self) -> None:
        if self._busy is not None and not self._busy.done():
            self._busy.add_done_callback(lambda _: self.encoder.close())
        else:
            self.encoder.close()


async def speak(
    gateway: Pipeline,
    request: web.Request,
    rid: str,
    params: GenerateParams,
    *,
    endpoint: str,
    encoder: Encoder,
    mode: str,
    headers: dict[str, str],
    error: ErrorFn,
    started: float,
) -> web.StreamResponse:
    """Generate `params` and answer with `encoder`'s bytes in `mode` ("stream", "whole", "sse")."""
    synth = Synthesis(gateway, request, rid, params, started)
    coder = _Coder(encoder)
    outcome = "server_error"
    admitted = False
    gateway.metrics.in_flight.labels(endpoint).inc()
    try:
        rejected = await gateway.admission.acquire(lambda: _client_gone(request))
        if rejected is not None:
            log.debug("[%s] rejected (%s): %s", rid, rejected.reason, rejected.message)
            outcome = "rejected"
            gateway.metrics.rejected.labels(rejected.reason).inc()
            return error(rejected.status, rejected.message, {**headers, **rejected.headers})
        admitted = True
        # On the tap: when the HTTP request came in (before reading its body and the admission wait;
        # `received` is its first segment's submission), so a timeline covers all the first audio a
        # client sees.
        waited = time.monotonic() - started
        publish_stage(  # under its first segment's id, as its first audio's other stages
            synth.rids[0],
            "http_received",
            time.time() - waited,
            body_and_admission_ms=round(1000 * waited, 2),
        )
        if len(synth.segments) > 1:
            log.info("[%s] %d chars in %d segments", rid, len(params.text), len(synth.segments))
        first = await synth.next()
        if isinstance(first, Failed):
            log.info("[%s] failed before audio: %d %s", rid, first.status, first.message)
            outcome = outcome_of(first.status)
            return error(first.status, first.message, headers)
        if isinstance(first, Done) and not first.complete:
            return error(503, ABORTED_BEFORE_AUDIO, headers)
        if mode == "sse":
            resp, outcome = await _sse(request, synth, coder, first, headers)
        elif mode == "stream" and encoder.streaming:
            resp, outcome = await _stream(request, synth, coder, first, headers)
        else:
            resp, outcome = await _whole(synth, coder, first, headers, error)
        return resp
    except asyncio.CancelledError:
        log.info("[%s] client disconnected", rid)  # aiohttp cancels the handler when it notices
        outcome = "cancelled"
        raise
    except ClientGone:
        log.info("[%s] client disconnected", rid)
        outcome = "cancelled"
        # Nobody reads this; 499 ("client closed request", as nginx logs it) is for the access log.
        return web.Response(status=499, headers=headers)
    finally:
        synth.close()
        coder.close()
        if admitted:
            gateway.admission.release()
        gateway.metrics.in_flight.labels(endpoint).dec()
        gateway.metrics.finished(endpoint, outcome)


async def _pump(
    out: _Writer,
    synth: Synthesis,
    coder: _Coder,
    event: Event,
    wrap: Callable[[bytes], bytes],
) -> Event:
    """Encode and write audio events as they come; returns the first event that is not audio."""
    first = True
    while isinstance(event, bytes):
        data = await coder.feed(event)
        if data:
            await out.write(wrap(data))
            if first:
                publish_stage(synth.rids[0], "first_byte_sent", bytes=len(data))  # the tap's id for it
                first = False
        event = await synth.next()
    return event


def _delta(data: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": _b64(data)})


async def _stream(
    request: web.Request, synth: Synthesis, coder: _Coder, event: Event, headers: dict[str, str]
) -> tuple[web.StreamResponse, str]:
    resp = web.StreamResponse(
        status=200,
        headers={**headers, "Content-Type": coder.encoder.content_type, "Cache-Control": "no-store"},
    )
    rid = headers.get("X-Request-Id", "")
    out = _Writer(request, resp, synth.gateway.cfg.gateway.send_timeout)
    try:
        await resp.prepare(request)  # no Content-Length: aiohttp sends it chunked (HTTP/1.1)
        event = await _pump(out, synth, coder, event, lambda data: data)
        if isinstance(event, Done) and event.complete:
            _played(synth)
            tail = await coder.finish()
            if tail:
                await out.write(tail)
            await out.write_eof()
            log.info("[%s] streamed %.2f s of audio (%s)", rid, _seconds(synth), _ending(event))
            return resp, "ok"
    except (ConnectionError, ClientGone):
        # The client went away; returning the prepared response lets aiohttp finish quietly.
        log.info("[%s] client disconnected after %.2f s of audio", rid, _seconds(synth))
        return resp, "cancelled"
    why = event.message if isinstance(event, Failed) else "cancelled by the workers"
    log.warning("[%s] failed after %.2f s of audio: %s; breaking the stream", rid, _seconds(synth), why)
    _break_stream(request)
    return resp, outcome_of(event.status) if isinstance(event, Failed) else "server_error"


def _played(synth: Synthesis) -> None:
    """A streamed request's audio is complete: if it fell behind playback at the gateway, by how far
    (`voxpipe_stream_behind_seconds`)."""
    if synth.behind_s > 0:
        synth.gateway.metrics.stream_behind.observe(synth.behind_s)


def _ending(done: Done) -> str:
    """How the workers ended a request, for its log line: "stop after 412 tokens"."""
    return f"{done.reason.name.lower()} after {done.n_tokens} tokens"


async def _whole(
    synth: Synthesis, coder: _Coder, event: Event, headers: dict[str, str], error: ErrorFn
) -> tuple[web.Response, str]:
    rid = headers.get("X-Request-Id", "")
    while isinstance(event, bytes):
        await coder.feed(event)
        event = await synth.next()
    if isinstance(event, Failed):
        log.info("[%s] failed: %d %s", rid, event.status, event.message)
        return error(event.status, event.message, headers), outcome_of(event.status)
    if not event.complete:
        return error(503, ABORTED_BEFORE_END, headers), "server_error"
    body = await coder.finish()
    publish_stage(synth.rids[0], "first_byte_sent", bytes=len(body))  # aiohttp sends it as we return
    log.info("[%s] returning %.2f s of audio (%s)", rid, _seconds(synth), _ending(event))
    return web.Response(body=body, headers={**headers, "Content-Type": coder.encoder.content_type}), "ok"


async def _sse(
    request: web.Request, synth: Synthesis, coder: _Coder, event: Event, headers: dict[str, str]
) -> tuple[web.StreamResponse, str]:
    resp = web.StreamResponse(
        status=200,
        headers={
            **headers,
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies (nginx) must not hold events back
        },
    )
    rid = headers.get("X-Request-Id", "")
    out = _Writer(request, resp, synth.gateway.cfg.gateway.send_timeout)
    try:
        await resp.prepare(request)
        event = await _pump(out, synth, coder, event, _delta)
        if isinstance(event, Done) and event.complete:
            _played(synth)
            tail = await coder.finish()
            if tail:
                await out.write(_delta(tail))
            usage = {
                "input_tokens": event.n_prompt_tokens,
                "output_tokens": event.n_tokens,
                "total_tokens": event.n_prompt_tokens + event.n_tokens,
            }
            await out.write(sse_event({"type": "speech.audio.done", "usage": usage}))
            await out.write_eof()
            log.info("[%s] streamed %.2f s of audio as events (%s)", rid, _seconds(synth), _ending(event))
            return resp, "ok"
        status, message = (
            (event.status, event.message) if isinstance(event, Failed) else (503, ABORTED_BEFORE_END)
        )
        log.warning("[%s] failed after %.2f s of audio: %s", rid, _seconds(synth), message)
        await out.write(sse_event({"type": "error", "error": error_body(status, message)}))
        await out.write_eof()
        return resp, outcome_of(status)
    except (ConnectionError, ClientGone):
        log.info("[%s] client disconnected after %.2f s of audio", rid, _seconds(synth))
        return resp, "cancelled"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON in its data line (no `event:` line, as
    OpenAI sends them: the type is in the payload, and EventSource.onmessage sees every event)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: {"message", "type", "param", "code"}."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"message": message, "type": kind, "param": param, "code": code or _CODES.get(status, "error")}


_CODES = {
    400: "invalid_value",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _seconds(synth: Synthesis) -> float:
    return synth.n_samples / synth.gateway.sample_rate


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _break_stream(request: web.Request) -> None:
    """End a chunked response without its terminating chunk, so the client sees a broken
    transfer instead of a short file that looks complete. close() (not abort()) flushes the
    audio already written; aiohttp's later write_eof then fails quietly on the closed transport."""
    if request.transport is not None:
        request.transport.close()
