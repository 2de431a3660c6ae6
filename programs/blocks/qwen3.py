"""Qwen3 decoder pieces on top of the Llama ones: per-head RMSNorm of queries and keys (QK-norm)
before RoPE, and multimodal RoPE (MRoPE), whose rotary channels each follow one of three position
rows (temporal, height, width).

Based on transformers' Qwen3 attention (models/qwen3/modeling_qwen3.py) and Qwen2-VL / Qwen3-Omni's
`apply_multimodal_rotary_pos_emb`: the same parameter names (`q_norm`, `k_norm`) and arithmetic
(norm in fp32 over the head dim, then rotate-half RoPE). MRoPE splits the head's D/2 frequencies
into `sections`: contiguous blocks, one per row; or, `interleaved`, frequency f follows row
i = f % 3 where i > 0 and f < 3 * sections[i], and row 0 elsewhere. When all three rows hold one
position (text, or speech tokens that carry no image grid), MRoPE equals plain RoPE.
"""

from __future__ import annotations

from typing import Any

import torch

from programs.blocks.llama import DecoderLayer, Factory, RMSNorm, SelfAttention


def mrope_rows(sections: list[int], interleaved: bool, device: torch.device | None = None) -> torch.Tensor:
    """Which position row (0, 1, 2) each of the D/2 = sum(sections) frequencies follows → [D/2] int64."""
    half = sum(sections)
    if interleaved:
        # transformers: row 0 everywhere, then row i at f = i, i + 3, ... below 3 * sections[i].
        rows = torch.zeros(half, dtype=torch.int64)
        for i, n in enumerate(sections[1:], 1):
            rows[i : n * len(sections) : len(sections)] = i
    else:
        rows = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(sections)])
    return rows.to(device)


def mrope_cos_sin(
    inv_freq: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] for positions pos [3, N] (or [N]: one position for all three rows): angles in
    float32, each frequency at its row's position, cast to `dtype` (as transformers)."""
    if pos.dim() == 1:
        pos = pos[None, :].expand(3, -1)
    row_pos = pos.float().index_select(0, rows)  # [D/2, N]: each frequency's position row
    freqs = row_pos.t() * inv_freq.float()[None, :]  # [N, D/2] float32
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen3SelfAttention(SelfAttention):
    """Llama attention with `q_norm` / `k_norm` (RMSNorm over each head's D) before RoPE."""

    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: Factory) -> None:
        super().__init__(cfg, head_dim, fk)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps, fk)
        self.k_norm = RMSNorm(head_dim, eps, fk)

    def queries_keys(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().queries_keys(x, n)
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(DecoderLayer):
    """A Llama layer whose attention has QK-norm; runs in `programs.blocks.llama.decoder_stack`."""

    attention = Qwen3SelfAttention
    default_eps = 1e-6
