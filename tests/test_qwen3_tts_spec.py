"""programs/qwen3_tts/spec.py's ids, speakers and languages are the shipped configs' (the published
config.json values), and the tiny config keeps the real ids, so prompts built from the spec fit it."""

from __future__ import annotations

import json
import os

import pytest

from programs.qwen3_tts import spec

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs")
NAMES = sorted(os.listdir(CONFIGS))


@pytest.mark.parametrize("name", NAMES)
def test_spec_ids_are_the_configs(name):
    with open(os.path.join(CONFIGS, name)) as f:
        config = json.load(f)
    tc = config["talker_config"]
    top = (
        spec.IM_START_ID,
        spec.IM_END_ID,
        spec.ASSISTANT_ID,
        spec.TTS_PAD_ID,
        spec.TTS_BOS_ID,
        spec.TTS_EOS_ID,
    )
    keys = ("im_start", "im_end", "assistant", "tts_pad", "tts_bos", "tts_eos")
    assert top == tuple(config[f"{k}_token_id"] for k in keys)
    codec = (
        spec.CODEC_PAD,
        spec.CODEC_BOS,
        spec.CODEC_EOS,
        spec.THINK,
        spec.NOTHINK,
        spec.THINK_BOS,
        spec.THINK_EOS,
    )
    keys = ("pad_id", "bos_id", "eos_token_id", "think_id", "nothink_id", "think_bos_id", "think_eos_id")
    assert codec == tuple(tc[f"codec_{k}"] for k in keys)
    assert (tc["num_code_groups"], tc["vocab_size"], tc["code_predictor_config"]["vocab_size"]) == (
        spec.N_CODEBOOKS,
        spec.TALKER_VOCAB,
        spec.CODE_VOCAB,
    )
    languages = tc["codec_language_id"]
    assert {k: v for k, v in spec.LANGUAGES.items() if k in languages} == languages
    if config["tts_model_type"] == "custom_voice":
        assert tc["spk_id"] == spec.SPEAKERS and languages == spec.LANGUAGES
        assert {k: v for k, v in tc["spk_is_dialect"].items() if v} == spec.SPEAKER_DIALECT
    else:
        assert tc["spk_id"] == {} and not any("dialect" in k for k in languages)
