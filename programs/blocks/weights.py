"""Checkpoint plumbing shared by the programs: where a checkpoint lives, reading its safetensors
shards into a module with every name and shape checked, and the random weights of
`--load-format dummy`."""

from __future__ import annotations

import glob
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


def load_safetensors(
    path: str,
    device: str | torch.device,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]],
    keep: Callable[[str], bool] = lambda name: True,
) -> set[str]:
    """Every tensor of the *.safetensors shards in `path` whose name `keep` accepts, read straight
    onto `device` one at a time and handed to `load` (a module's `load_weights`); → the names loaded."""
    from safetensors import safe_open

    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {path}; convert the checkpoint to safetensors")
    loaded: set[str] = set()
    for shard in shards:
        with safe_open(shard, framework="pt", device=str(torch.device(device))) as f:
            loaded |= load((name, f.get_tensor(name)) for name in f.keys() if keep(name))
    return loaded


@torch.no_grad()
def random_weights(module: nn.Module, device: str | torch.device, seed: int) -> None:
    """The random weights of `--load-format dummy`: norm weights 1, biases 0, every other parameter
    normal with std 0.02, drawn on `device` in the parameters' dtype in a fixed order (shared, tied
    weights once), so a (seed, device type) always gives the same model."""
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
