"""Model registry. Specs (torch-free constants) and programs (torch) are imported lazily, so the
gateway can read a model's spec without importing torch."""

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
}


def model_names() -> list[str]:
    return sorted(_MODELS)


def _lookup(name: str) -> tuple[str, str]:
    key = name.lower()
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


def load_program_class(name: str) -> type:
    package, _ = _lookup(name)
    module = importlib.import_module(f"programs.{package}.program")
    return module.PROGRAM
