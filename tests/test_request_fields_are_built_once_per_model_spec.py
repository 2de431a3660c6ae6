"""The gateway builds a request's field tables (`gateway.validation.generate_fields`,
`speech_fields`, the voice aliases) once per model spec, config and saved voices, not per request
(`gateway.fields.per_spec`), and a new spec, config or voice list gets tables of its own: a voice
the model gains is accepted at once, one it loses is refused."""

from __future__ import annotations

import msgspec
import pytest

from common.config import ServeConfig
from gateway.fields import PER_SPEC_MAX, BadRequest
from gateway.validation import generate_fields, parse_generate, parse_speech, speech_fields, voice_aliases
from tests.specs import model_spec

SPEC = model_spec("orpheus-tiny")
CFG = ServeConfig(model="orpheus-tiny")


def test_the_same_spec_and_config_read_the_same_tables():
    assert generate_fields(SPEC, CFG) is generate_fields(SPEC, CFG)
    assert speech_fields(SPEC, CFG, ("mine",)) is speech_fields(SPEC, CFG, ("mine",))
    assert voice_aliases(SPEC) is voice_aliases(SPEC)
    # saved voices match by value: a request's tuple of names is built anew each time
    assert speech_fields(SPEC, CFG, tuple(["mine"])) is speech_fields(SPEC, CFG, ("mine",))


def test_a_new_spec_config_or_voice_list_gets_tables_of_its_own():
    voices = list(SPEC.voices)
    renamed = msgspec.structs.replace(SPEC, voices=[*voices[1:], "newcomer"])
    assert generate_fields(renamed, CFG) is not generate_fields(SPEC, CFG)
    assert parse_generate({"text": "hi", "voice": "newcomer"}, renamed, CFG).voice == "newcomer"
    with pytest.raises(BadRequest, match="unknown voice"):
        parse_generate({"text": "hi", "voice": "newcomer"}, SPEC, CFG)
    with pytest.raises(BadRequest, match="unknown voice"):
        parse_generate({"text": "hi", "voice": voices[0]}, renamed, CFG)
    assert voice_aliases(renamed)["alloy"] == renamed.voices[0] != voice_aliases(SPEC)["alloy"]
    other = ServeConfig(model="orpheus-tiny")
    assert generate_fields(SPEC, other) is not generate_fields(SPEC, CFG)
    body = {"model": "orpheus-tiny", "input": "hi", "voice": "mine"}
    assert parse_speech(body, SPEC, CFG, ("mine",)).voice == "mine"
    with pytest.raises(BadRequest, match="unknown voice"):
        parse_speech(body, SPEC, CFG, ("yours",))


def test_specs_built_per_request_do_not_pile_up():
    """A caller that builds a spec per request gets right answers and a bounded memo."""
    for i in range(3 * PER_SPEC_MAX):
        spec = msgspec.structs.replace(SPEC, voices=[f"v{i}"])
        assert parse_generate({"text": "hi", "voice": f"v{i}"}, spec, CFG).voice == f"v{i}"
    assert 0 < len(generate_fields.memo) <= PER_SPEC_MAX
