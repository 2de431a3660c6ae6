"""The Qwen3-TTS reference (qwen-tts-compat) for the parity tests, entered without its package
`__init__`, or the test skipped where it is missing or cannot run."""

from __future__ import annotations

import importlib
import importlib.util
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
    spec = importlib.util.find_spec("qwen_tts")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("reference missing: pip install --no-deps qwen-tts-compat==0.1.1.post1")
    root = list(spec.submodule_search_locations)[0]
    for package_name, path in (("qwen_tts", root), ("qwen_tts.inference", os.path.join(root, "inference"))):
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [path]
            sys.modules[package_name] = package
    wrapper = "qwen_tts.inference.qwen3_tts_tokenizer"
    if wrapper not in sys.modules:
        placeholder = types.ModuleType(wrapper)
        placeholder.Qwen3TTSTokenizer = None
        sys.modules[wrapper] = placeholder
    return importlib.import_module(name)
