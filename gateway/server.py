"""The gateway's HTTP app: aiohttp routes in front of the pipeline client (`gateway.pipeline`).

Endpoints: `POST /generate`, `GET /metrics`, `GET /health`, `GET /ready` (here), `POST
/v1/audio/speech` and `GET /v1/models` (OpenAI's API, in `gateway.openai`), the saved voices under
`/v1/audio/voices` (`gateway.voice_api`), `GET
/v1/audio/speech/stream` (a WebSocket for text that arrives in pieces, `gateway.websocket`), `GET
/openapi.json` (`gateway.openapi`). Every handler talks to the workers through one `Pipeline`;
imports go one way: server → voice_api → openai, openapi, respond → synthesis → pipeline, and server →
websocket → live → pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from common.config import ServeConfig
from common.ipc import Addresses
from gateway import auth, openai, openapi, voice_api, websocket
from gateway.body import CLIP_FIELD, BodyError, Upload, body_limit, read_fields
from gateway.cloning import clone_voice
from gateway.encoders import WavEncoder
from gateway.events import Failed
from gateway.metrics import CONTENT_TYPE, outcome_of
from gateway.pipeline import IDLE_TIMEOUT_S, SUBMIT_TIMEOUT_S, Pipeline
from gateway.respond import error_body, speak
from gateway.validation import BadRequest, parse_generate

log = logging.getLogger(__name__)

GATEWAY = web.AppKey("gateway", Pipeline)
ENDPOINTS = (
    "POST /generate, POST /v1/audio/speech, GET /v1/audio/speech/stream (WebSocket), GET /v1/models, "
    "POST|GET /v1/audio/voices, DELETE /v1/audio/voices/{name}, GET /openapi.json, GET /metrics, "
    "GET /health, GET /ready"
)


class Routes:
    """The handlers of /generate, /health, /ready and /metrics over one pipeline."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def generate(self, request: web.Request) -> web.StreamResponse:
        pipeline = self.pipeline
        started = time.monotonic()
        rid, clash = pipeline.request_id(request)
        headers = {"X-Request-Id": rid}
        if clash:
            return _error(409, clash, headers)
        spec = pipeline.model_spec()
        if isinstance(spec, Failed):
            pipeline.metrics.finished("generate", outcome_of(spec.status))
            return _error(spec.status, spec.message, {**headers, **pipeline.spec_retry()})
        try:
            g = pipeline.cfg.gateway
            # A clip is read for any model, so that one which does not clone says so (below).
            fields = await read_fields(request, g.body_timeout, clip_bytes=g.max_reference_bytes)
            upload = fields.pop(CLIP_FIELD, None)
            if upload is not None and not isinstance(upload, Upload):
                raise BadRequest("field 'audio' is the reference clip: send it as a file in a multipart form")
            params = parse_generate(fields, spec, pipeline.cfg, tuple(pipeline.voices.names(spec.name)))
            cloned = await clone_voice(pipeline, spec, params, upload)
            if isinstance(cloned, Failed):
                pipeline.metrics.finished("generate", outcome_of(cloned.status))
                return _error(cloned.status, cloned.message, headers)
            params = cloned
        except (BodyError, BadRequest) as e:
            status = e.status
            pipeline.metrics.finished("generate", outcome_of(status))
            return _error(status, str(e), headers)
        except ConnectionError:
            raise  # the client went away while sending its body; nothing to answer
        except Exception:
            log.exception("[%s] failed to read the request", rid)
            pipeline.metrics.finished("generate", "server_error")
            return _error(500, "internal error while reading the request", headers)
        return await speak(
            pipeline,
            request,
            rid,
            params,
            endpoint="generate",
            encoder=WavEncoder(spec.sample_rate, params.streaming),
            mode="stream" if params.streaming else "whole",
            headers=headers,
            error=_error,
            started=started,
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when every process reports READY and the model's spec has arrived: a tokenizer
        worker's READY status and its spec travel on different sockets, so either may come first."""
        ready, rows = self.pipeline.procs.report()
        spec = self.pipeline.spec
        ready = ready and spec is not None
        model = self.pipeline.cfg.model or (spec.name if spec is not None else "")
        body = {"ready": ready, "model": model, "processes": rows}
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.pipeline.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE  # has a version parameter: not content_type=
        return resp


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _release_request_id(request: web.Request, handler: Any) -> web.StreamResponse:
    """The request id a handler claimed (`Pipeline.request_id`) is given back when it returns."""
    try:
        return await handler(request)
    finally:
        request.app[GATEWAY].unclaim(request)


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
        headers: dict[str, str] = {}
        if e.status == 404:
            message = f"no such endpoint {request.path}; endpoints: {ENDPOINTS}"
        elif e.status == 405:
            allowed = ", ".join(sorted(_allowed(e)))
            message = f"{request.method} is not allowed on {request.path}; allowed: {allowed}"
            headers["Allow"] = allowed  # RFC 9110: a 405 lists the methods the resource supports
        else:
            message = e.text or e.reason
        if openai_shape:
            return web.json_response(
                {"error": error_body(e.status, message)}, status=e.status, headers=headers
            )
        return _error(e.status, message, headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        if openai_shape:
            return web.json_response({"error": error_body(500, "internal error")}, status=500)
        return _error(500, "internal error")


@web.middleware
async def _hang_up_on_408(request: web.Request, handler: Any) -> web.StreamResponse:
    """A 408 (a body that stalled past --body-timeout) is sent and then the connection is closed:
    aiohttp would otherwise linger up to 10 s reading the rest of a body that is not coming, which
    keeps a stalled client's socket open that long past its answer."""
    resp = await handler(request)
    if resp.status == 408 and not resp.prepared:
        resp.force_close()  # "Connection: close"
        await resp.prepare(request)
        await resp.write_eof()
        request.protocol.force_close()  # the transport closes once the answer is written out
    return resp


def _allowed(e: web.HTTPException) -> set[str]:
    return set(getattr(e, "allowed_methods", ()) or ())


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
    pipeline = Pipeline(cfg, addresses, idle_timeout_s=idle_timeout_s, submit_timeout_s=submit_timeout_s)
    middlewares = [_release_request_id, _hang_up_on_408, _json_errors]
    key = auth.load_api_key(cfg)
    if key is not None:
        middlewares.append(auth.middleware(key, error_body))
        log.info("the HTTP API requires a Bearer key (except /health and /ready)")
    # aiohttp's own cap is the largest body an endpoint reads (one with a reference clip);
    # gateway.body holds each endpoint to its own.
    app = web.Application(
        client_max_size=body_limit(cfg.gateway.max_reference_bytes), middlewares=middlewares
    )
    app[GATEWAY] = pipeline
    routes = Routes(pipeline)
    app.router.add_post("/generate", routes.generate)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.metrics)
    openai.add_routes(app, pipeline)
    voice_api.add_routes(app, pipeline)
    websocket.add_routes(app, pipeline, key)
    openapi.add_routes(app, pipeline, requires_key=key is not None)
    app.on_startup.append(pipeline.start)
    app.on_shutdown.append(pipeline.shutdown)
    app.on_cleanup.append(pipeline.stop)
    return app
