"""`task_type` (vLLM-Omni's field) offers what each model serves: CustomVoice for preset voices,
VoiceDesign for a voice described in instructions, Base for cloning, alone for a cloning model
without preset voices (Qwen3-TTS Base), beside CustomVoice for one with them (CSM)."""

from __future__ import annotations

import pytest

from gateway.omni_fields import omni_fields
from programs import get_spec, load_program_class


@pytest.mark.parametrize(
    "model, default, choices",
    [
        ("qwen3-tts-tiny", "CustomVoice", ("CustomVoice",)),
        ("qwen3-tts-base-tiny", "Base", ("Base",)),
        ("csm-tiny", "CustomVoice", ("CustomVoice", "Base")),
        ("orpheus-tiny", "CustomVoice", ("CustomVoice",)),
    ],
)
def test_task_types(model: str, default: str, choices: tuple[str, ...]) -> None:
    spec = load_program_class(model)(get_spec(model), load_format="dummy").model_spec(model)
    [field] = [f for f in omni_fields(spec) if f.name == "task_type"]
    assert field.default == default
    assert tuple(field.choices) == choices
