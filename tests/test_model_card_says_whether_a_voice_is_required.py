"""The model card says whether a model speaks only in a cloned voice (`voice_required`): Qwen3-TTS
Base does (it has no voice of its own, and refuses a request without one); the models with preset
or described voices, or a default voice, do not. Benchmarks read it to send plain requests plain."""

from __future__ import annotations

import pytest

from programs import get_spec, load_program_class


@pytest.mark.parametrize(
    ("name", "required"),
    [("qwen3-tts-base-tiny", True), ("qwen3-tts-tiny", False), ("higgs-tts-tiny", False), ("chatterbox-tiny", False),
     ("orpheus-tiny", False)],
)  # fmt: skip
def test_the_model_spec_says_whether_a_voice_is_required(name, required):
    program = load_program_class(name)(get_spec(name), load_format="dummy")
    program.load_prompts()
    spec = program.model_spec(name)
    assert spec.voice_required is required
    if required:
        assert spec.reference_sample_rate > 0 and not spec.voices
        with pytest.raises(ValueError):
            program.preprocess("Hello there.", {})
