"""OpenAI's speech API: `POST /v1/audio/speech`, `GET /v1/models`, `GET /v1/models/{model}`.

Request fields follow OpenAI's (`model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`, `instructions`), vLLM-Omni's and SGLang-Omni's (`stream`, `language`, `task_type`,
`non_streaming_mode`, `ref_audio`, `ref_text`: `gateway.omni_fields`), plus voxpipe's sampling
options and `streaming`; see `gateway.validation.speech_fields`. Raw PCM answers carry the sample
rate in the `X-Sample-Rate` header, as SGLang-Omni's do. Errors on these endpoints keep OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. The served model is accepted under its own
name, the registry's other names for it, and OpenAI's model names (tts-1, tts-1-hd,
gpt-4o-mini-tts), so OpenAI clients work unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from common.messages import ModelSpec
from gateway.body import BodyError, read_fields
from gateway.cloning import clone_voice
from gateway.encoders import available_formats, make_encoder
from gateway.events import Failed
from gateway.metrics import outcome_of
from gateway.respond import error_body, speak
from gateway.segments import text_limit
from gateway.validation import BadRequest, accepted_models, max_tokens_limit, parse_speech, voice_aliases

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline

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


def model_card(pipeline: Pipeline, spec: ModelSpec) -> dict[str, Any]:
    """The served model as an OpenAI model object, with what a speech client needs to know."""
    saved = pipeline.voices.names(spec.name)
    return {
        "id": spec.name,
        "object": "model",
        "created": pipeline.created,
        "owned_by": "voxpipe",
        "aliases": accepted_models(spec)[1:],
        "voices": [*spec.voices, *saved],
        "saved_voices": saved,
        "voice_cloning": spec.reference_sample_rate > 0,
        "voice_required": spec.voice_required,
        "default_voice": spec.default_voice,
        "voice_aliases": voice_aliases(spec),
        "languages": ["auto", *spec.languages],
        "options": dict(spec.options),
        "sample_rate": spec.sample_rate,
        "response_formats": list(available_formats(spec.sample_rate)),
        "max_input_chars": text_limit(pipeline.cfg),
        "max_tokens": max_tokens_limit(spec, pipeline.cfg),
    }


class OpenAIRoutes:
    """The /v1 handlers of one gateway."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def speech(self, request: web.Request) -> web.StreamResponse:
        gateway = self.pipeline
        started = time.monotonic()
        rid, clash = gateway.request_id(request)
        headers = {"X-Request-Id": rid}
        if clash:
            return openai_error(409, clash, headers)
        spec = gateway.model_spec()
        if isinstance(spec, Failed):
            gateway.metrics.finished("speech", outcome_of(spec.status))
            return openai_error(spec.status, spec.message, {**headers, **gateway.spec_retry()})
        try:
            g = gateway.cfg.gateway
            clip_bytes = g.max_reference_bytes if spec.reference_sample_rate > 0 else 0
            body = await read_fields(request, g.body_timeout, clip_bytes, inline=clip_bytes > 0)
            saved = tuple(gateway.voices.names(spec.name))
            params = parse_speech(body, spec, gateway.cfg, saved)
            encoder = make_encoder(params.response_format, spec.sample_rate, params.streaming)
            cloned = await clone_voice(gateway, spec, params)
            if isinstance(cloned, Failed):
                gateway.metrics.finished("speech", outcome_of(cloned.status))
                return openai_error(cloned.status, cloned.message, headers, "ref_audio")
            params = cloned
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
        if params.response_format == "pcm" and params.stream_format == "audio":
            headers["X-Sample-Rate"] = str(spec.sample_rate)  # raw samples carry no rate of their own
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
        spec = self.pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message)
        return web.json_response({"object": "list", "data": [model_card(self.pipeline, spec)]})

    async def model(self, request: web.Request) -> web.Response:
        spec = self.pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message)
        name = request.match_info["model"]
        if name.lower() not in {m.lower() for m in accepted_models(spec)}:
            return openai_error(
                404,
                f"model {name!r} is not served here; this server serves {spec.name}",
                code="model_not_found",
            )
        return web.json_response(model_card(self.pipeline, spec))


def add_routes(app: web.Application, pipeline: Pipeline) -> None:
    routes = OpenAIRoutes(pipeline)
    app.router.add_post("/v1/audio/speech", routes.speech)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # ids may hold a slash (org/name)
