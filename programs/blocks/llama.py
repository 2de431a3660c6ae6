"""Llama decoder pieces shared by every Llama-style model: parameters, linear, embedding, RMSNorm,
attention over the runtime's paged cache, SiLU-gated MLP, decoder layer, and the unfused stack.

Based on transformers' `LlamaForCausalLM` (models/llama/modeling_llama.py): the same parameter
names, so published checkpoints load unchanged, and the same arithmetic (fp32 RMSNorm, rotate-half
RoPE, SiLU-gated MLP). Tokens arrive flattened as rows [N] of many requests, and attention is the
runtime's `attn.forward(layer, q, k, v)`, so a stack can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.base import Attention
from programs.blocks import fp8
from programs.blocks.rope import rotate_half

Factory = dict[str, Any]  # {"dtype": ..., "device": ...} for every parameter


def param(*shape: int, fk: Factory) -> nn.Parameter:
    # Uninitialized and frozen: values come from a checkpoint or `LlamaLM.dummy`, so a 3B model is
    # allocated straight on its device with no throwaway init (nn.Linear's costs seconds on CPU).
    return nn.Parameter(torch.empty(*shape, **fk), requires_grad=False)


class Linear(nn.Module):
    """nn.Linear's parameters and math, without its initialization."""

    def __init__(
        self, d_in: int, d_out: int, bias: bool, fk: Factory, tied: nn.Parameter | None = None
    ) -> None:
        super().__init__()
        self.weight = tied if tied is not None else param(d_out, d_in, fk=fk)
        self.register_parameter("bias", param(d_out, fk=fk) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.bias)  # F.linear, but see fp8.rows_apart


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, fk: Factory) -> None:
        super().__init__()
        self.weight = param(num, dim, fk=fk)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fk: Factory) -> None:
        super().__init__()
        self.weight = param(dim, fk=fk)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, cast back before the weight, as HF does (matters for bf16 parity).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: Factory) -> None:
        super().__init__()
        hidden, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = head_dim
        self.q_proj = Linear(hidden, self.num_heads * head_dim, bias, fk)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, bias, fk)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, bias, fk)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, bias, fk)

    def queries_keys(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [N, H] → queries [N, Hq, D] and keys [N, Hkv, D] before RoPE."""
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return q, k

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn: Attention
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k = self.queries_keys(x, n)  # [N, Hq, D], [N, Hkv, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attn.forward(layer, q, k, v)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], fk: Factory) -> None:
        super().__init__()
        hidden, inter, bias = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False)
        self.gate_proj = Linear(hidden, inter, bias, fk)
        self.up_proj = Linear(hidden, inter, bias, fk)
        self.down_proj = Linear(inter, hidden, bias, fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """`self_attn`, `mlp` and the two RMSNorms, under transformers' names; a family whose layers
    differ only in their attention sets `attention` (and its configs' default `rms_norm_eps`)."""

    attention: type[SelfAttention] = SelfAttention
    default_eps = 1e-5

    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: Factory) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", self.default_eps)
        self.self_attn = self.attention(cfg, head_dim, fk)
        self.mlp = MLP(cfg, fk)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)


def row_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for rows x [N, H]; on a GPU as FlashInfer's RMSNorm, whose reduction runs one row
    per thread block in an order fixed by H alone, so a row's bits do not depend on how many rows
    the step holds (torch's reductions pick their split by the row count). It rounds once, in
    fp32, where HF casts back to the dtype before the weight. float32 rows take `norm`."""
    half = (torch.float16, torch.bfloat16)  # what FlashInfer's kernel takes, the weight alike
    if x.is_cuda and x.dim() == 2 and x.dtype in half and norm.weight.dtype == x.dtype:
        try:
            import flashinfer
        except ImportError:  # the gpu extra is not installed
            return norm(x)
        return flashinfer.rmsnorm(x.contiguous(), norm.weight, norm.eps)
    return norm(x)


def decoder_stack(layers, norm, hidden: torch.Tensor, cos, sin, attn: Attention) -> torch.Tensor:
    """The unfused Llama decoder layers over `hidden` [N, H], then the final norm (`row_norm`)."""
    for i, layer in enumerate(layers):
        hidden = hidden + layer.self_attn(row_norm(layer.input_layernorm, hidden), cos, sin, i, attn)
        hidden = hidden + layer.mlp(row_norm(layer.post_attention_layernorm, hidden))
    return row_norm(norm, hidden)
