"""OpenAI's speech API: `POST /v1/audio/speech`, `GET /v1/models`, `GET /v1/models/{model}`.

Request fields follow OpenAI's (`model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`, `instructions`) plus voxpipe's sampling options and `streaming`; see
`gateway.validation.speech_fields`. Errors on these endpoints keep OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. The served model is accepted under its own
name, the registry's other names for it, and OpenAI's model names (tts-1, tts-1-hd,
gpt-4o-mini-tts), so OpenAI clients work unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.body import BodyError, read_fields
from gateway.encoders import available_formats, make_encoder
from gateway.metrics import outcome_of
from gateway.respond import error_body, speak
from gateway.segments import text_limit
from gateway.validation import BadRequest, accepted_models, max_tokens_limit, parse_speech

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger(__name__)


def openai_error(
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """An error response in OpenAI's shape."""
    return web.json_response(
        {"error": error_body(status, message, param, code)}, status=status, headers=headers
    )


def model_card(gateway: Gateway) -> dict[str, Any]:
    """The served model as an OpenAI model object, with what a speech client needs to know."""
    spec = gateway.spec
    return {
        "id": gateway.cfg.model,
        "object": "model",
        "created": gateway.created,
        "owned_by": "voxpipe",
        "aliases": accepted_models(gateway.cfg.model)[1:],
        "voices": list(spec.get("voices", [])),
        "default_voice": spec.get("default_voice"),
        "sample_rate": gateway.sample_rate,
        "response_formats": list(available_formats(gateway.sample_rate)),
        "max_input_chars": text_limit(gateway.cfg),
        "max_tokens": max_tokens_limit(spec, gateway.cfg),
    }


class OpenAIRoutes:
    """The /v1 handlers of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def speech(self, request: web.Request) -> web.StreamResponse:
        gateway = self.gateway
        started = time.monotonic()
        rid, clash = gateway.request_id(request)
        headers = {"X-Request-Id": rid}
        if clash:
            return openai_error(409, clash, headers)
        try:
            params = parse_speech(await read_fields(request), gateway.spec, gateway.cfg)
            encoder = make_encoder(params.response_format, gateway.sample_rate, params.streaming)
        except BadRequest as e:
            gateway.metrics.finished("speech", outcome_of(e.status))
            return openai_error(e.status, str(e), headers, e.param, e.code)
        except BodyError as e:
            gateway.metrics.finished("speech", outcome_of(e.status))
            return openai_error(e.status, e.message, headers)
        except ConnectionError:
            raise  # the client went away while sending its body; nothing to answer
        except Exception:
            log.exception("[%s] failed to read the request", rid)
            gateway.metrics.finished("speech", "server_error")
            return openai_error(500, "internal error while reading the request", headers)
        mode = "sse" if params.stream_format == "sse" else ("stream" if params.streaming else "whole")
        return await speak(
            gateway,
            request,
            rid,
            params,
            endpoint="speech",
            encoder=encoder,
            mode=mode,
            headers=headers,
            error=openai_error,
            started=started,
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(self.gateway)]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        served = self.gateway.cfg.model
        if name.lower() not in {m.lower() for m in accepted_models(served)}:
            return openai_error(
                404, f"model {name!r} is not served here; this server serves {served}", code="model_not_found"
            )
        return web.json_response(model_card(self.gateway))


def add_routes(app: web.Application, gateway: Gateway) -> None:
    routes = OpenAIRoutes(gateway)
    app.router.add_post("/v1/audio/speech", routes.speech)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # ids may hold a slash (org/name)
