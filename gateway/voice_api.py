"""Saved voices over HTTP: `POST /v1/audio/voices`, `GET /v1/audio/voices`, `DELETE
/v1/audio/voices/{name}` (OpenAI's error shape, as the rest of /v1).

A POST is a multipart form with `name`, the clip as the file field `audio` and `ref_text` (or a
JSON object with `audio` as base64 or a data URL). The clip is decoded and encoded as a request's
clip is (gateway.cloning), then kept under its name for the served model (gateway.voices); from
then on `voice: <name>` on either speech endpoint uses it.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from gateway.body import BodyError, Upload, read_fields
from gateway.cloning import decode_upload, refuse_clip
from gateway.events import Failed
from gateway.fields import BadRequest
from gateway.omni_fields import REF_TEXT_MAX_CHARS
from gateway.openai import openai_error
from gateway.pipeline import Pipeline
from gateway.validation import voice_aliases
from gateway.voices import SavedVoice, VoiceError

log = logging.getLogger(__name__)

FIELDS = ("name", "audio", "ref_text")


class VoiceRoutes:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def create(self, request: web.Request) -> web.Response:
        pipeline = self.pipeline
        spec = pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message, pipeline.spec_retry())
        try:
            g = pipeline.cfg.gateway
            body = await read_fields(request, g.body_timeout, g.max_reference_bytes, inline=True)
            name, audio, text = _fields(body)
            if spec.reference_sample_rate <= 0:
                raise refuse_clip(spec, "audio")
            taken = {*spec.voices, *voice_aliases(spec)}
            pipeline.voices.check_free(name, taken)  # before the encoding: checked again after it
            clip = await decode_upload(pipeline, spec, audio, "audio")
            features = await pipeline.references.encode(clip, text)
            if isinstance(features, Failed):
                return openai_error(features.status, features.message)
            voice = SavedVoice(name, spec.name, text, features)
            pipeline.voices.save(voice, taken)
        except (BadRequest, BodyError, VoiceError) as e:
            return openai_error(e.status, str(e), param=getattr(e, "param", None))
        log.info(
            "saved voice %s (%.1f s of reference audio)", name, len(clip.audio) / spec.reference_sample_rate
        )
        return web.json_response(voice.card(), status=201)

    async def list(self, request: web.Request) -> web.Response:
        spec = self.pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message, self.pipeline.spec_retry())
        voices = self.pipeline.voices
        data = [voices.voices[n].card() for n in voices.names(spec.name)]
        return web.json_response({"object": "list", "data": data, "builtin": list(spec.voices)})

    async def delete(self, request: web.Request) -> web.Response:
        spec = self.pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message, self.pipeline.spec_retry())
        name = request.match_info["name"]
        try:
            self.pipeline.voices.delete(name, spec.name)
        except VoiceError as e:
            return openai_error(e.status, str(e), param="name")
        log.info("deleted voice %s", name)
        return web.json_response({"name": name, "object": "voice", "deleted": True})


def _fields(body: dict[str, Any]) -> tuple[str, Upload | str, str]:
    """(name, the clip, its text) of a POST body."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; a voice takes {', '.join(FIELDS)}", param=unknown[0])
    name, audio, text = body.get("name"), body.get("audio"), body.get("ref_text") or ""
    if not isinstance(name, str) or not name:
        raise BadRequest("field 'name' is required: the name to save the voice under", param="name")
    if not isinstance(audio, Upload | str) or not audio:
        raise BadRequest(
            "field 'audio' is required: the reference clip, a file in a multipart form (or base64 in JSON)",
            param="audio",
        )
    if not isinstance(text, str) or len(text) > REF_TEXT_MAX_CHARS:
        raise BadRequest(
            f"field 'ref_text' is a string of at most {REF_TEXT_MAX_CHARS} characters", param="ref_text"
        )
    return name, audio, text


def add_routes(app: web.Application, pipeline: Pipeline) -> None:
    routes = VoiceRoutes(pipeline)
    app.router.add_post("/v1/audio/voices", routes.create)
    app.router.add_get("/v1/audio/voices", routes.list)
    app.router.add_delete("/v1/audio/voices/{name}", routes.delete)
