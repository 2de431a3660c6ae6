"""`GET /openapi.json`: an OpenAPI 3.1 document of the gateway's HTTP API.

The request bodies are the field tables that validation runs on (`gateway.validation`), turned into
JSON Schema by `gateway.fields`, with this deployment's limits filled in (voices, max_tokens,
--max-text-chars, the formats libsndfile can encode): the document describes exactly what this
server accepts.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from aiohttp import web

from common.config import ServeConfig
from common.messages import ModelSpec
from gateway.encoders import available_formats, content_type
from gateway.events import Failed
from gateway.fields import schema_of
from gateway.incremental import session_fields
from gateway.validation import generate_fields, speech_fields

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline

_BINARY = {"type": "string", "format": "binary"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(schema: str, statuses: dict[int, str]) -> dict[str, Any]:
    return {
        str(status): {"description": why, "content": {"application/json": {"schema": _ref(schema)}}}
        for status, why in statuses.items()
    }


_REQUEST_ERRORS = {
    400: "A field is missing or invalid; the message names it and says what is allowed.",
    413: "The body is larger than 1 MiB.",
    415: "The Content-Type is not one the endpoint reads.",
    500: "An internal error.",
    503: "The server is at capacity and its queue is full (or the wait passed --queue-timeout): "
    "retry after the Retry-After header's seconds; or no worker could take the request (see /ready), "
    "or the gateway is shutting down.",
    504: "The workers made no progress for the idle timeout; the request was aborted.",
}


def document(spec: ModelSpec, cfg: ServeConfig) -> dict[str, Any]:
    """The OpenAPI document for the served model and this gateway's settings."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "voxpipe",
            "version": _version(),
            "description": f"Speech synthesis with {spec.name}: {spec.sample_rate} Hz mono audio.",
        },
        "paths": _paths(spec),
        "components": _components(spec, cfg),
    }


def _paths(spec: ModelSpec) -> dict[str, Any]:
    """Every endpoint with its request and responses (the saved voices' where the model clones)."""
    generate_body = {"schema": _ref("GenerateRequest")}
    generate_form = generate_body
    if spec.reference_sample_rate > 0:
        clip = {"audio": {**_BINARY, "description": "The reference clip (wav, flac, ogg, mp3)."}}
        generate_form = {"schema": {"allOf": [_ref("GenerateRequest"), {"properties": clip}]}}
    speech_audio = {content_type(f): {"schema": _BINARY} for f in available_formats(spec.sample_rate)}
    return {
        "/generate": {
            "post": {
                "summary": "Speak a text; WAV audio, streamed by default.",
                "description": "Form bodies carry the same fields as strings.",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": generate_body,
                        "application/x-www-form-urlencoded": generate_body,
                        "multipart/form-data": generate_form,
                    },
                },
                "responses": {
                    "200": {
                        "description": "PCM16 mono WAV.",
                        "content": {"audio/wav": {"schema": _BINARY}},
                    },
                    **_errors("Error", _REQUEST_ERRORS),
                },
            }
        },
        "/v1/audio/speech": {
            "post": {
                "summary": "OpenAI-compatible speech: the text in the requested audio format.",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("SpeechRequest")}},
                },
                "responses": {
                    "200": {
                        "description": "The audio (stream_format audio), or server-sent events (sse).",
                        "content": {
                            **speech_audio,
                            "text/event-stream": {"schema": _ref("SpeechStreamEvent")},
                        },
                    },
                    **_errors("OpenAIError", {**_REQUEST_ERRORS, 404: "The model is not served here."}),
                },
            }
        },
        **(_voice_paths() if spec.reference_sample_rate > 0 else {}),
        "/v1/audio/speech/stream": {
            "get": {
                "summary": "Input streaming over a WebSocket: text appended in pieces, PCM16 frames back.",
                "description": (
                    "Upgrade to a WebSocket. The client's first message is a WebSocketSession (JSON "
                    'text); then {"type": "append", "text"} (answered with {"type": "ack", "seq"}), '
                    '{"type": "flush"}, {"type": "end"} and {"type": "clear"} (barge-in: abort every '
                    'generation, answered with {"type": "cleared"}). The server sends binary frames of '
                    "PCM16 mono at the model's sample rate, in order, and JSON events: session.started, "
                    "audio.started, segment.done, done (usage), error (message, param, fatal). The API "
                    'key goes in the Authorization header or as "api_key" in the session message. See '
                    "docs/api.md for the whole protocol."
                ),
                "responses": {
                    "101": {"description": "Switching to the WebSocket protocol."},
                    **_errors(
                        "OpenAIError",
                        {400: "Not a WebSocket upgrade.", 503: "The model is not known yet (see /ready)."},
                    ),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The served model, its voices and sample rate.",
                "responses": {"200": _json("The model list.", _ref("ModelList"))},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model, by its id or an alias.",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _json("The model.", _ref("Model")),
                    **_errors("OpenAIError", {404: "The model is not served here."}),
                },
            }
        },
        "/health": {
            "get": {"summary": "200 while the gateway runs.", "responses": {"200": _json("OK.", {})}}
        },
        "/ready": {
            "get": {
                "summary": "Whether every process is ready and the model known, and each process's state.",
                "responses": {"200": _json("All ready.", {}), "503": _json("Not all ready.", {})},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format).",
                "responses": {"200": {"description": "Metrics.", "content": {"text/plain": {}}}},
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document.", "responses": {"200": _json("OpenAPI 3.1.", {})}}
        },
    }


def _voice_paths() -> dict[str, Any]:
    """The saved voices' endpoints (docs/api.md, "Voice cloning")."""
    new_voice = _object(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-])?$"},
            "audio": {**_BINARY, "description": "The reference clip (JSON: base64 or a data URL)."},
            "ref_text": {"type": "string", "description": "What the clip says."},
        }
    )
    new_voice["required"] = ["name", "audio"]
    errors = {**_REQUEST_ERRORS, 409: "The name is a voice of the model's or a saved voice's."}
    return {
        "/v1/audio/voices": {
            "post": {
                "summary": "Save a voice: a reference clip encoded once, usable by name as voice.",
                "requestBody": {
                    "required": True,
                    "content": {
                        t: {"schema": new_voice} for t in ("multipart/form-data", "application/json")
                    },
                },
                "responses": {
                    "201": _json("The saved voice.", _ref("Voice")),
                    **_errors("OpenAIError", errors),
                },
            },
            "get": {
                "summary": "The voices saved for the served model.",
                "responses": {"200": _json("The saved voices.", _ref("VoiceList"))},
            },
        },
        "/v1/audio/voices/{name}": {
            "delete": {
                "summary": "Delete a saved voice.",
                "parameters": [
                    {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _json(
                        "Deleted.", _object({"name": {"type": "string"}, "deleted": {"const": True}})
                    ),
                    **_errors("OpenAIError", {404: "No saved voice has the name."}),
                },
            }
        },
    }


def _components(spec: ModelSpec, cfg: ServeConfig) -> dict[str, Any]:
    """The request, error, event and model schemas the paths refer to."""
    return {
        "schemas": {
            "GenerateRequest": schema_of(generate_fields(spec, cfg)),
            "SpeechRequest": schema_of(speech_fields(spec, cfg)),
            "WebSocketSession": _session_schema(spec, cfg),
            "Error": _object({"error": {"type": "string", "description": "What to change."}}),
            "OpenAIError": _object(
                {
                    "error": _object(
                        {
                            "message": {"type": "string"},
                            "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        }
                    )
                }
            ),
            "SpeechStreamEvent": {"oneOf": [_ref("SpeechAudioDeltaEvent"), _ref("SpeechAudioDoneEvent")]},
            "SpeechAudioDeltaEvent": _object(
                {
                    "type": {"const": "speech.audio.delta"},
                    "audio": {"type": "string", "description": "Base64 of the next encoded bytes."},
                }
            ),
            "SpeechAudioDoneEvent": _object(
                {
                    "type": {"const": "speech.audio.done"},
                    "usage": _object(
                        {k: {"type": "integer"} for k in ("input_tokens", "output_tokens", "total_tokens")}
                    ),
                }
            ),
            "Model": _object(
                {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "aliases": {"type": "array", "items": {"type": "string"}},
                    "voices": {"type": "array", "items": {"type": "string"}},
                    "saved_voices": {"type": "array", "items": {"type": "string"}},
                    "voice_cloning": {"type": "boolean"},
                    "voice_required": {"type": "boolean"},
                    "default_voice": {"type": "string"},
                    "voice_aliases": {"type": "object", "additionalProperties": {"type": "string"}},
                    "languages": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object", "additionalProperties": {"type": "string"}},
                    "sample_rate": {"type": "integer"},
                    "response_formats": {"type": "array", "items": {"type": "string"}},
                    "max_input_chars": {"type": "integer"},
                    "max_tokens": {"type": "integer"},
                }
            ),
            "Voice": _object(
                {
                    "name": {"type": "string"},
                    "object": {"const": "voice"},
                    "model": {"type": "string"},
                    "ref_text": {"type": "string"},
                    "created": {"type": "integer"},
                }
            ),
            "VoiceList": _object(
                {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": _ref("Voice")},
                    "builtin": {"type": "array", "items": {"type": "string"}},
                }
            ),
            "ModelList": _object(
                {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}
            ),
        }
    }


def _session_schema(spec: ModelSpec, cfg: ServeConfig) -> dict[str, Any]:
    """The first message of a WebSocket session: its fields, `type` and the optional `api_key`."""
    schema = schema_of(session_fields(spec, cfg))
    schema["properties"] = {
        "type": {"const": "session"},
        **schema["properties"],
        "api_key": {"type": "string", "description": "The API key, for clients that cannot set headers."},
    }
    schema["required"] = ["type", *schema.get("required", [])]
    return schema


def _secure(doc: dict[str, Any]) -> dict[str, Any]:
    """With an API key: a bearer scheme for every operation but /health and /ready, and their 401."""
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if path in ("/health", "/ready"):
                op["security"] = []
            else:
                shape = "OpenAIError" if path.startswith("/v1/") else "Error"
                op["responses"].update(_errors(shape, {401: "No valid Authorization: Bearer key."}))
    return doc


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _version() -> str:
    try:
        return importlib.metadata.version("voxpipe")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def add_routes(app: web.Application, pipeline: Pipeline, requires_key: bool) -> None:
    docs: dict[int, dict[str, Any]] = {}  # id(spec) → its document: it depends only on spec and config

    async def handle_openapi(request: web.Request) -> web.Response:
        spec = pipeline.model_spec()
        if isinstance(spec, Failed):
            return web.json_response({"error": spec.message}, status=spec.status)
        doc = docs.get(id(spec))
        if doc is None:
            docs.clear()  # a newer announcement replaced the spec
            doc = docs[id(spec)] = (
                _secure(document(spec, pipeline.cfg)) if requires_key else document(spec, pipeline.cfg)
            )
        return web.json_response(doc)

    app.router.add_get("/openapi.json", handle_openapi)
