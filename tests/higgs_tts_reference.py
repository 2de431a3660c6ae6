"""transformers' Higgs Audio v2 (the reference) built from the shipped configs with the weights of
our programs, for the parity tests: the LM (`HiggsAudioV2ForConditionalGeneration`) and the
tokenizer's decode (`HiggsAudioV2TokenizerModel.decode`).

The tokenizer's module imports torchaudio for the resampling its encoder does; the decoder never
calls it, and the venv has no torchaudio, so `reference_tokenizer` registers an empty module under
that name before importing it."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import torch


def reference_lm(lm, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """HiggsAudioV2ForConditionalGeneration with the config and weights of `lm` (a HiggsLM), built
    on `device` in `dtype`."""
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    cfg = {k: v for k, v in lm.config.items() if k not in ("architectures", "model_type")}
    with torch.device(device):
        ref = HiggsAudioV2ForConditionalGeneration._from_config(HiggsAudioV2Config(**cfg), dtype=dtype).eval()
    missing, unexpected = ref.load_state_dict(lm.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return ref


def reference_tokenizer(codec, config_path: str) -> torch.nn.Module:
    """HiggsAudioV2TokenizerModel of the config at `config_path` with `codec`'s decoder weights."""
    if "torchaudio" not in sys.modules:
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        stub.__version__ = "0.0"
        sys.modules["torchaudio"] = stub
    from transformers import HiggsAudioV2TokenizerConfig
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    with open(config_path) as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    ref = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**cfg)).eval()
    state = {k: v for k, v in codec.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    return ref
