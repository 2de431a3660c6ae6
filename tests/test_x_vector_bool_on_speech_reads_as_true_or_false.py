"""vLLM-Omni's clients send `x_vector_only_mode` as a JSON boolean; /v1/audio/speech reads it as the
model option "true" or "false", as it reads those strings. Other types stay refused, and a boolean
for a field typed by the omni table (non_streaming_mode) is read as that field's boolean."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from gateway.fields import BadRequest, FormFields
from gateway.validation import parse_speech
from tests.specs import model_spec

MODEL = "qwen3-tts-base-tiny"
SPEC = model_spec(MODEL)
CFG = ServeConfig(model=MODEL)
CLIP = "data:audio/wav;base64,UklGRg=="  # ref_audio is read later (gateway.cloning): any text here


def options(**fields) -> dict[str, str]:
    body = {"model": MODEL, "input": "Hello.", "ref_audio": CLIP, **fields}
    return dict(parse_speech(body, SPEC, CFG).options)


def test_a_json_boolean_reads_as_the_options_true_or_false():
    assert "x_vector_only_mode" in SPEC.options
    assert options(x_vector_only_mode=True)["x_vector_only_mode"] == "true"
    assert options(x_vector_only_mode=False)["x_vector_only_mode"] == "false"
    assert options(x_vector_only_mode="true") == options(x_vector_only_mode=True)
    assert "x_vector_only_mode" not in options()


def test_other_types_stay_refused_and_typed_omni_fields_keep_their_booleans():
    for value in (1, 0.0, ["true"], {"on": True}):
        with pytest.raises(BadRequest, match="x_vector_only_mode"):
            options(x_vector_only_mode=value)
    typed = dict(parse_speech({"model": MODEL, "input": "Hi.", "ref_audio": CLIP, "non_streaming_mode": True},
                              SPEC, CFG).options)  # fmt: skip
    assert typed.get("non_streaming_mode", "").lower() == "true"
    form = FormFields({"model": MODEL, "input": "Hi.", "ref_audio": CLIP, "x_vector_only_mode": "false"})
    assert dict(parse_speech(form, SPEC, CFG).options)["x_vector_only_mode"] == "false"
