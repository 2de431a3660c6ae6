"""Checkpoint plumbing shared by the programs: where a checkpoint lives, and copying named weights
into a module's parameters with every name and shape checked."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def checkpoint_dir(id_or_dir: str) -> tuple[str, dict[str, Any]]:
    """A local directory, or a Hugging Face repo downloaded (config and safetensors only);
    → (directory, its config.json)."""
    path = id_or_dir
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(id_or_dir, allow_patterns=["*.json", "*.safetensors"])
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


@torch.no_grad()
def copy_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: Callable[[str], bool]
) -> set[str]:
    """Copy (name, tensor) pairs into `module`'s parameters (cast to their dtype and device);
    names `skip` accepts are passed over; → the names loaded. An unknown name or a wrong shape
    raises: a silently ignored weight is a wrong model."""
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        if name not in params:
            raise KeyError(f"checkpoint weight {name!r} has no place in {type(module).__name__}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
        params[name].copy_(tensor)
        loaded.add(name)
    return loaded
