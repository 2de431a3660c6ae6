"""The Qwen3-TTS reference (qwen-tts-compat) for the parity tests, entered without its package
`__init__`, or the test skipped where it is missing or cannot run."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import types

import pytest
import transformers
from packaging.version import Version


def reference_module():
    """The reference's modeling module. Its package `__init__` imports the whole inference API,
    whose speech-tokenizer wrapper imports the 25 Hz tokenizer and with it torchaudio (no build for
    this torch); the talker never reaches them (only `from_pretrained` loads a speech tokenizer), so
    the packages are entered without their `__init__` and that one module is a placeholder."""
    name = "qwen_tts.core.models.modeling_qwen3_tts"
    if name in sys.modules:
        return sys.modules[name]
    pytest.importorskip("librosa", reason="the reference's modeling file imports librosa")
    if Version(transformers.__version__) >= Version("5.24"):
        pytest.skip(
            "qwen-tts-compat 0.1.1.post1 runs on transformers 5.9-5.23: from 5.24 a model output's "
            "`past_key_values` is passed as `cache`, which the reference's output classes lack"
        )
    root = _enter_package()
    if "qwen_tts.inference" not in sys.modules:
        package = types.ModuleType("qwen_tts.inference")
        package.__path__ = [os.path.join(root, "inference")]
        sys.modules["qwen_tts.inference"] = package
    wrapper = "qwen_tts.inference.qwen3_tts_tokenizer"
    if wrapper not in sys.modules:
        placeholder = types.ModuleType(wrapper)
        placeholder.Qwen3TTSTokenizer = None
        sys.modules[wrapper] = placeholder
    return importlib.import_module(name)


def _enter_package() -> str:
    """Enter `qwen_tts` without its `__init__` (or skip where it is missing) → its folder."""
    spec = importlib.util.find_spec("qwen_tts")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("reference missing: pip install --no-deps qwen-tts-compat==0.1.1.post1")
    root = list(spec.submodule_search_locations)[0]
    if "qwen_tts" not in sys.modules:
        package = types.ModuleType("qwen_tts")
        package.__path__ = [root]
        package.__spec__ = spec
        sys.modules["qwen_tts"] = package
    return root


def tokenizer_modules():
    """The reference's 12 Hz tokenizer modules (modeling, configuration); they need none of the
    package's inference API."""
    _enter_package()
    modeling = importlib.import_module("qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2")
    configuration = importlib.import_module(
        "qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2"
    )
    return modeling, configuration


def reference_decoder(path: str):
    """The reference's `Qwen3TTSTokenizerV2Decoder` built from the tokenizer config at `path`."""
    modeling, configuration = tokenizer_modules()
    with open(path) as f:
        cfg = configuration.Qwen3TTSTokenizerV2DecoderConfig(**json.load(f)["decoder_config"])
    return modeling.Qwen3TTSTokenizerV2Decoder(cfg).eval()
