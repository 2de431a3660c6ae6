"""The Qwen3-TTS reference (qwen-tts-compat) for the parity tests, entered without its package
`__init__`, or the test skipped where it is missing or cannot run."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import types

import pytest
import torch
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


def reference_speech_tokenizer(path: str, decoder_state: dict):
    """The reference's `Qwen3TTSTokenizer` (its 12 Hz `decode`) over a `Qwen3TTSTokenizerV2Model`
    of the tokenizer config at `path` whose decoder has `decoder_state`'s weights.

    Its module imports the 25 Hz tokenizer, which needs torchaudio: those two modules are
    placeholders (the 12 Hz decode never reaches them). The model is built without its encoder,
    which does not build on this transformers (its Mimi base class's `upsample` is a property
    here) and which a decode never uses: the decoder and the config are what `decode` reads."""
    root = _enter_package()
    reference_module()  # the `qwen_tts.inference` package, entered without its __init__
    v1 = {
        "configuration_qwen3_tts_tokenizer_v1": "Qwen3TTSTokenizerV1Config",
        "modeling_qwen3_tts_tokenizer_v1": "Qwen3TTSTokenizerV1Model",
    }
    for module, cls in v1.items():
        name = f"qwen_tts.core.tokenizer_25hz.{module}"
        if name not in sys.modules:
            placeholder = types.ModuleType(name)
            setattr(placeholder, cls, None)
            sys.modules[name] = placeholder
    name = "qwen_tts.inference.qwen3_tts_tokenizer_12hz"  # the real wrapper, beside the placeholder
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(root, "inference", "qwen3_tts_tokenizer.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    modeling, configuration = tokenizer_modules()
    with open(path) as f:
        config = configuration.Qwen3TTSTokenizerV2Config(**json.load(f))
    model = modeling.Qwen3TTSTokenizerV2Model.__new__(modeling.Qwen3TTSTokenizerV2Model)
    torch.nn.Module.__init__(model)
    model.config = config
    model.decode_upsample_rate = config.decode_upsample_rate
    model.output_sample_rate = config.output_sample_rate
    model.decoder = modeling.Qwen3TTSTokenizerV2Decoder(config.decoder_config).eval()
    model.decoder.load_state_dict(decoder_state, strict=True)
    tokenizer = sys.modules[name].Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = model.eval(), config, torch.device("cpu")
    return tokenizer


class TextIdsProcessor:
    """The reference wrapper's text processor for a model without a Hugging Face tokenizer (the
    tiny ones), for the texts the wrapper builds: `<|im_start|>assistant` and `<|im_end|>` as their
    ids, every other piece (split at them and at newlines) as `text_ids` (the program's tokenizer)
    gives it."""

    def __init__(self, text_ids, im_start: int, assistant: int, im_end: int) -> None:
        self.text_ids = text_ids
        self.special = {"<|im_start|>assistant": [im_start, assistant], "<|im_end|>": [im_end]}

    def __call__(self, text: str, return_tensors: str = "pt", padding: bool = True) -> dict:
        ids: list[int] = []
        for piece in re.split(r"(<\|im_start\|>assistant|<\|im_end\|>|\n)", text):
            ids += self.special[piece] if piece in self.special else self.text_ids(piece) if piece else []
        return {"input_ids": torch.tensor([ids])}


def voice_clone_wrapper(model, speech_tokenizer, processor):
    """The reference's `Qwen3TTSModel` (its `generate_voice_clone`) around a Base
    `Qwen3TTSForConditionalGeneration`, with `speech_tokenizer` as its codec."""
    reference_module()
    wrapper = importlib.import_module("qwen_tts.inference.qwen3_tts_model")
    model.load_speech_tokenizer(speech_tokenizer)
    return wrapper.Qwen3TTSModel(model, processor), wrapper.VoiceClonePromptItem
