"""programs/qwen3_tts/spec.py's ids, speakers and languages are the shipped configs' (the published
config.json values), and the tiny config keeps the real ids, so prompts built from these constants fit it."""

from __future__ import annotations

import json
import os

import pytest

from programs.qwen3_tts import spec as constants

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs")
NAMES = sorted(n for n in os.listdir(CONFIGS) if not n.startswith("qwen3-tts-tokenizer-"))  # the talker's


@pytest.mark.parametrize("name", NAMES)
def test_spec_ids_are_the_configs(name):
    with open(os.path.join(CONFIGS, name)) as f:
        config = json.load(f)
    tc = config["talker_config"]
    top = (
        constants.IM_START_ID,
        constants.IM_END_ID,
        constants.ASSISTANT_ID,
        constants.TTS_PAD_ID,
        constants.TTS_BOS_ID,
        constants.TTS_EOS_ID,
    )
    keys = ("im_start", "im_end", "assistant", "tts_pad", "tts_bos", "tts_eos")
    assert top == tuple(config[f"{k}_token_id"] for k in keys)
    codec = (
        constants.CODEC_PAD,
        constants.CODEC_BOS,
        constants.CODEC_EOS,
        constants.THINK,
        constants.NOTHINK,
        constants.THINK_BOS,
        constants.THINK_EOS,
    )
    keys = ("pad_id", "bos_id", "eos_token_id", "think_id", "nothink_id", "think_bos_id", "think_eos_id")
    assert codec == tuple(tc[f"codec_{k}"] for k in keys)
    assert (tc["num_code_groups"], tc["vocab_size"], tc["code_predictor_config"]["vocab_size"]) == (
        constants.N_CODEBOOKS,
        constants.TALKER_VOCAB,
        constants.CODE_VOCAB,
    )
    languages = tc["codec_language_id"]
    assert {k: v for k, v in constants.LANGUAGES.items() if k in languages} == languages
    if config["tts_model_type"] == "custom_voice":
        assert tc["spk_id"] == constants.SPEAKERS and languages == constants.LANGUAGES
        assert {k: v for k, v in tc["spk_is_dialect"].items() if v} == constants.SPEAKER_DIALECT
    else:
        assert tc["spk_id"] == {} and not any("dialect" in k for k in languages)
