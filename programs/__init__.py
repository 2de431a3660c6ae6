"""Model registry: --model names → the model's folder under programs/. Specs (torch-free constants)
and programs (torch) are imported lazily, so the registry itself loads no torch (`voxpipe serve`
checks --model with it). The gateway never imports this package: the tokenizer workers announce
the model's facts to it (`LMProgram.model_spec`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

# --model name → (package under programs/, spec name inside its spec.py SPECS)
_MODELS: dict[str, tuple[str, str]] = {
    "orpheus": ("orpheus", "orpheus"),
    "orpheus-3b": ("orpheus", "orpheus"),
    "canopylabs/orpheus-3b-0.1-ft": ("orpheus", "orpheus"),
    "orpheus-tiny": ("orpheus", "orpheus-tiny"),
    "csm": ("csm", "csm"),
    "csm-1b": ("csm", "csm"),
    "sesame/csm-1b": ("csm", "csm"),
    "csm-tiny": ("csm", "csm-tiny"),
    "qwen3-tts": ("qwen3_tts", "qwen3-tts"),
    "qwen3-tts-1.7b": ("qwen3_tts", "qwen3-tts"),
    "qwen/qwen3-tts-12hz-1.7b-customvoice": ("qwen3_tts", "qwen3-tts"),
    "qwen3-tts-0.6b": ("qwen3_tts", "qwen3-tts-0.6b"),
    "qwen/qwen3-tts-12hz-0.6b-customvoice": ("qwen3_tts", "qwen3-tts-0.6b"),
    "qwen3-tts-voicedesign": ("qwen3_tts", "qwen3-tts-voicedesign"),
    "qwen/qwen3-tts-12hz-1.7b-voicedesign": ("qwen3_tts", "qwen3-tts-voicedesign"),
    "qwen3-tts-tiny": ("qwen3_tts", "qwen3-tts-tiny"),
    "qwen3-tts-base": ("qwen3_tts", "qwen3-tts-base"),
    "qwen3-tts-base-1.7b": ("qwen3_tts", "qwen3-tts-base"),
    "qwen/qwen3-tts-12hz-1.7b-base": ("qwen3_tts", "qwen3-tts-base"),
    "qwen3-tts-base-0.6b": ("qwen3_tts", "qwen3-tts-base-0.6b"),
    "qwen/qwen3-tts-12hz-0.6b-base": ("qwen3_tts", "qwen3-tts-base-0.6b"),
    "qwen3-tts-base-tiny": ("qwen3_tts", "qwen3-tts-base-tiny"),
    "higgs-tts": ("higgs_tts", "higgs-tts"),
    "higgs-audio-v2": ("higgs_tts", "higgs-tts"),
    "bosonai/higgs-audio-v2-generation-3b-base": ("higgs_tts", "higgs-tts"),
    "higgs-tts-tiny": ("higgs_tts", "higgs-tts-tiny"),
    "chatterbox": ("chatterbox", "chatterbox"),
    "resembleai/chatterbox": ("chatterbox", "chatterbox"),
    "chatterbox-tiny": ("chatterbox", "chatterbox-tiny"),
}

DEFAULT_MODEL = "orpheus-tiny"  # what --model "" (the default) serves: random weights, no download


def model_names() -> list[str]:
    return sorted(_MODELS)


def served_name(name: str) -> str:
    """The name a deployment serves for --model `name`: `name`, or DEFAULT_MODEL for ""."""
    return name or DEFAULT_MODEL


def _lookup(name: str) -> tuple[str, str]:
    key = served_name(name).lower()
    if key in _MODELS:
        return _MODELS[key]
    raise ValueError(f"unknown model {name!r}; --model takes one of: {', '.join(model_names())}")


def get_spec(name: str) -> dict[str, Any]:
    """The model's constants (torch-free): voices, sample rate, sampling defaults, limits…"""
    package, spec_name = _lookup(name)
    specs = importlib.import_module(f"programs.{package}.spec").SPECS
    return dict(specs[spec_name])


def rows_per_second(spec: Mapping[str, Any]) -> float:
    """Rows the model generates per second of audio: each regular codec window adds
    detok_interval - detok_overlap rows' worth of detok_samples samples (Orpheus: 24000 / 2048 * 7
    = 82.03). The real-time pace a stream needs."""
    stride = int(spec["detok_interval"]) - int(spec.get("detok_overlap", 0))
    return float(spec["sample_rate"]) / float(spec["detok_samples"]) * stride


def aliases_of(name: str) -> list[str]:
    """Every registry name of the model `name` names (itself included), sorted."""
    package, spec_name = _lookup(name)
    return [n for n in model_names() if _MODELS[n] == (package, spec_name)]


def model_words() -> set[str]:
    """Lower-case words that name a served model or its codec: each model's package, spec names,
    codec and checkpoint owners. Runtime code outside programs/ never says them
    (tests/test_architecture.py), so a new model's registry line extends the check."""
    words: set[str] = set()
    for package, spec_name in set(_MODELS.values()):
        spec = importlib.import_module(f"programs.{package}.spec").SPECS[spec_name]
        words |= {package, spec_name, str(spec.get("codec", ""))}
        for checkpoint in (spec.get("hf_id"), spec.get("codec_id")):
            if checkpoint and "/" in checkpoint:
                words.add(checkpoint.split("/")[0])
    return {w.lower() for w in words if w}


def load_program_class(name: str) -> type:
    package, _ = _lookup(name)
    module = importlib.import_module(f"programs.{package}.program")
    return module.PROGRAM
