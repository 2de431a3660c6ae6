"""Rotary position embeddings of Llama models, as transformers computes them.

Based on transformers' llama RoPE (`_compute_llama3_parameters` in modeling_rope_utils.py): the same
dtype and op order, so positions rotate identically: inverse frequencies in fp32 on CPU (with the
llama3 scaling when the config asks for it), angles in fp32 cast to the activation dtype, rotate-half.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from either config layout: transformers 4 (`rope_theta` + `rope_scaling`) or
    transformers 5 (`rope_parameters` holding both)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, dict(scaling)


def llama3_inv_freq(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2] float32, computed on CPU exactly as transformers
    does (same dtype and op order), so positions rotate identically."""
    theta, scaling = rope_settings(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; this Llama supports 'default' and 'llama3'")
    factor = scaling["factor"]
    low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    low_freq_wavelen, high_freq_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] for positions pos [N]: angles in float32, cast to `dtype` (as transformers)."""
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]  # [N, D/2] float32
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def cos_sin_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """[P, D] float32 for positions 0..P-1: cos then sin of position × frequency, FlashInfer's RoPE
    cache layout (`apply_rope_with_cos_sin_cache_inplace`)."""
    pos = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
