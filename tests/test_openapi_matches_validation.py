"""`GET /openapi.json` describes what the gateway accepts: every bound, choice and length limit the
document states is checked against the validation code, from both sides of the limit."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from common.config import GatewaySettings, ServeConfig
from gateway.fields import BadRequest
from gateway.validation import parse_generate, parse_speech, voice_aliases
from tests.specs import model_spec
from tests.test_gateway import MAX_TEXT, Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

SPEC = model_spec("orpheus-tiny")
CFG = ServeConfig(model="orpheus-tiny", gateway=GatewaySettings(max_text_chars=MAX_TEXT))
MINIMAL = {"GenerateRequest": {"text": "hi"}, "SpeechRequest": {"model": "orpheus-tiny", "input": "hi"}}
PARSERS: dict[str, Callable[..., Any]] = {"GenerateRequest": parse_generate, "SpeechRequest": parse_speech}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    from gateway.openapi import document

    return document(SPEC, CFG)


def _accepts(schema_name: str, **fields: Any) -> bool:
    body = {**MINIMAL[schema_name], **fields}
    try:
        PARSERS[schema_name](body, SPEC, CFG)
    except BadRequest:
        return False
    return True


def _cases(prop: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(value, accepted?) pairs at and just past every limit the schema states."""
    cases: list[tuple[Any, bool]] = []
    kind = prop["type"]
    step = 1 if kind == "integer" else 1e-6
    if "minimum" in prop:
        cases += [(prop["minimum"], True), (prop["minimum"] - step, False)]
    if "exclusiveMinimum" in prop:
        cases += [(prop["exclusiveMinimum"], False), (prop["exclusiveMinimum"] + step, True)]
    if "maximum" in prop:
        cases += [(prop["maximum"], True), (prop["maximum"] + step, False)]
    if "enum" in prop:
        cases += [(v, True) for v in prop["enum"]] + [("no-such-value", False)]
    if "maxLength" in prop:
        cases += [("a" * prop["maxLength"], prop.get("minLength", 0) <= prop["maxLength"])]
        cases += [("a" * (prop["maxLength"] + 1), False)]
    if kind == "boolean":
        cases += [(b, b in prop.get("enum", (True, False))) for b in (True, False)] + [("maybe", False)]
        cases += [("true", False), (1, False)]  # a JSON body's boolean is true or false
    if kind in ("number", "integer"):
        cases += [("not a number", False)]
        if "default" in prop:
            cases += [(str(prop["default"]), False)]  # a JSON body's number is no string
    cases += [(None, False)]  # null is no value of the stated type: leave a field out for its default
    if "default" in prop:
        cases += [(prop["default"], True)]
    return cases


@pytest.mark.parametrize("schema_name", ["GenerateRequest", "SpeechRequest"])
def test_every_documented_limit_is_the_one_validation_enforces(doc: dict[str, Any], schema_name: str) -> None:
    schema = doc["components"]["schemas"][schema_name]
    assert schema["additionalProperties"] is False and not _accepts(schema_name, no_such_field=1)
    for name in schema["required"]:
        body = {k: v for k, v in MINIMAL[schema_name].items() if k != name}
        with pytest.raises(BadRequest, match=f"'{name}' is required"):
            PARSERS[schema_name](body, SPEC, CFG)
    checked = 0
    for name, prop in schema["properties"].items():
        for value, ok in _cases(prop):
            if name == "streaming" and value is False and schema_name == "SpeechRequest":
                ok = True  # accepted with the default stream_format (audio)
            assert _accepts(schema_name, **{name: value}) == ok, (name, value, ok)
            checked += 1
    assert checked > 60


def test_document_states_this_deployments_limits(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.1")
    gen = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    speech = doc["components"]["schemas"]["SpeechRequest"]["properties"]
    assert gen["text"]["maxLength"] == speech["input"]["maxLength"] == MAX_TEXT
    assert gen["voice"]["enum"] == SPEC.voices
    # /v1/audio/speech also takes OpenAI's voice names, each an alias of one of the model's
    assert speech["voice"]["enum"] == SPEC.voices + list(voice_aliases(SPEC))
    assert gen["max_tokens"]["maximum"] == SPEC.max_tokens == 400
    assert gen["temperature"]["default"] == SPEC.sampling.temperature
    assert speech["response_format"]["default"] == "mp3"
    assert speech["speed"]["minimum"] == speech["speed"]["maximum"] == 1
    assert speech["model"]["enum"][0] == "orpheus-tiny" and "tts-1" in speech["model"]["enum"]
    assert list(gen) == ["text", "voice", "streaming", "temperature", "top_p", "top_k", "min_p",
                         "repetition_penalty", "seed", "max_tokens", "min_tokens"]  # fmt: skip


def test_document_lists_every_route_with_its_error_responses(doc: dict[str, Any]) -> None:
    paths = doc["paths"]
    assert set(paths) == {
        "/generate",
        "/v1/audio/speech",
        "/v1/audio/speech/stream",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
    }
    generate = paths["/generate"]["post"]
    assert set(generate["requestBody"]["content"]) == {
        "application/json",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    }
    assert {"200", "400", "413", "415", "500", "503", "504"} <= set(generate["responses"])
    err = generate["responses"]["400"]["content"]["application/json"]["schema"]
    assert err == {"$ref": "#/components/schemas/Error"}
    speech = paths["/v1/audio/speech"]["post"]
    assert {"200", "400", "404", "413", "415", "500", "503", "504"} <= set(speech["responses"])
    assert speech["responses"]["404"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/OpenAIError"
    )
    assert set(speech["responses"]["200"]["content"]) == {
        "audio/mpeg",
        "audio/ogg; codecs=opus",
        "audio/flac",
        "audio/wav",
        "audio/pcm",
        "text/event-stream",
    }
    # Every reference resolves.
    schemas = doc["components"]["schemas"]
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)


async def test_gateway_serves_the_document(rig: Rig) -> None:
    resp = await rig.client.get("/openapi.json")
    body = await resp.json()
    assert resp.status == 200 and body["paths"]["/generate"]["post"]["summary"]
    assert body["components"]["schemas"]["GenerateRequest"]["properties"]["text"]["maxLength"] == MAX_TEXT
