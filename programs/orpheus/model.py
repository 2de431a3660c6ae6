"""Llama decoder for Orpheus (Llama-3.2-3B backbone), written for the serving runtime.

Based on transformers' `LlamaForCausalLM` (models/llama/modeling_llama.py) and its llama3 RoPE
(`_compute_llama3_parameters` in modeling_rope_utils.py): same parameter names, so a published
checkpoint or an HF state_dict loads unchanged, and the same arithmetic (fp32 RMSNorm, fp32 cos/sin
cast to the activation dtype, rotate-half RoPE, SiLU-gated MLP), so logits match HF's.

What differs is the calling convention: tokens arrive flattened as rows `[N]` of many requests
with explicit positions, and attention is delegated to the runtime's `attn.forward(layer, q, k, v)`
(paged KV cache), so the whole step can be captured in a CUDA graph: cos/sin are computed from
`pos` on the fly, with no host sync and no Python branch on tensor values.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs import fp8
from programs.base import Attention
from programs.weights import checkpoint_dir, copy_weights


def _rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from either config layout: transformers 4 (`rope_theta` + `rope_scaling`) or
    transformers 5 (`rope_parameters` holding both)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, dict(scaling)


def llama3_inv_freq(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2] float32, computed on CPU exactly as transformers
    does (same dtype and op order), so positions rotate identically."""
    theta, scaling = _rope_settings(config)
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


def decoder_stack(layers, norm, hidden: torch.Tensor, cos, sin, attn: Attention) -> torch.Tensor:
    """The unfused Llama decoder layers over `hidden` [N, H], then the final norm."""
    for i, layer in enumerate(layers):
        hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), cos, sin, i, attn)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return norm(hidden)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


Factory = dict[str, Any]  # {"dtype": ..., "device": ...} for every parameter


def _param(*shape: int, fk: Factory) -> nn.Parameter:
    # Uninitialized and frozen: values come from a checkpoint or `LlamaLM.dummy`, so a 3B model is
    # allocated straight on its device with no throwaway init (nn.Linear's costs seconds on CPU).
    return nn.Parameter(torch.empty(*shape, **fk), requires_grad=False)


class Linear(nn.Module):
    """nn.Linear's parameters and math, without its initialization."""

    def __init__(
        self, d_in: int, d_out: int, bias: bool, fk: Factory, tied: nn.Parameter | None = None
    ) -> None:
        super().__init__()
        self.weight = tied if tied is not None else _param(d_out, d_in, fk=fk)
        self.register_parameter("bias", _param(d_out, fk=fk) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.bias)  # F.linear, but see fp8.rows_apart


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, fk: Factory) -> None:
        super().__init__()
        self.weight = _param(num, dim, fk=fk)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fk: Factory) -> None:
        super().__init__()
        self.weight = _param(dim, fk=fk)
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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn: Attention
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
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
    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: Factory) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.self_attn = SelfAttention(cfg, head_dim, fk)
        self.mlp = MLP(cfg, fk)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)


class LlamaModel(nn.Module):
    """Holds the `model.*` parameters (embeddings, layers, final norm) under HF's names."""

    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: Factory) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg["vocab_size"], cfg["hidden_size"], fk)
        self.layers = nn.ModuleList(DecoderLayer(cfg, head_dim, fk) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5), fk)


class LlamaLM(nn.Module):
    """Llama causal LM; `state_dict()` keys equal `LlamaForCausalLM`'s.

    The constructor allocates uninitialized, frozen weights directly on `device`; fill them with
    `load_state_dict`, `load_weights`, `from_pretrained`, `from_state_dict` or `dummy`.
    """

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = dict(config)
        self.vocab_size: int = config["vocab_size"]
        self.hidden_size: int = config["hidden_size"]
        self.num_layers: int = config["num_hidden_layers"]
        self.num_qo_heads: int = config["num_attention_heads"]
        self.num_kv_heads: int = config["num_key_value_heads"]
        self.head_dim: int = config.get("head_dim") or self.hidden_size // self.num_qo_heads
        self.tie_word_embeddings: bool = config.get("tie_word_embeddings", False)
        fk: Factory = {"dtype": dtype, "device": torch.device(device)}
        self.model = LlamaModel(config, self.head_dim, fk)
        tied = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        self.lm_head = Linear(self.hidden_size, self.vocab_size, False, fk, tied=tied)
        # Kept fp32 whatever the weight dtype: RoPE angles are computed in fp32, as in HF.
        inv_freq = llama3_inv_freq(config, self.head_dim).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32
        self.fused = False  # see fuse()

    # --- forward pieces (graph-safe) -------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # [N] int64 → [N, H]

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        """hidden [N, H], pos [N] int64 → [N, H] after the final norm."""
        if self.fused:
            return self._backbone_fused(hidden, pos, attn)
        cos, sin = rope_cos_sin(self.inv_freq, pos, hidden.dtype)
        return decoder_stack(self.model.layers, self.model.norm, hidden, cos, sin, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, H] → [B, V] float32

    # --- GPU fast path ---------------------------------------------------------------------------
    @torch.no_grad()
    def fuse(self, max_positions: int) -> None:
        """Switch to fused GPU kernels: q/k/v and gate/up weights concatenated into one GEMM each,
        FlashInfer RMSNorm (fused with the residual add), RoPE from a cos/sin table, SiLU-and-mul.
        About 12 kernels per layer instead of ~45, which is what a small-batch decode step is made
        of. Same math as `backbone`, in a different rounding order (bf16 tolerance, not bitwise);
        the separate weights are freed, so this is one-way."""
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # [(Hq+2Hkv)D, H]
            m.gate_up_weight = torch.cat([m.gate_proj.weight, m.up_proj.weight])  # [2I, H]
            if any(x.bias is not None for x in (a.q_proj, a.o_proj, m.gate_proj, m.down_proj)):
                raise ValueError("fuse() supports bias-free Llama projections only")
            # Plain tensors, not Parameters, so quantize_fp8 may replace them.
            a.o_weight, m.down_weight = a.o_proj.weight.detach(), m.down_proj.weight.detach()
            del a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj
        pos = torch.arange(max_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]  # [P, D/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D] float32
        self.fused = True

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """The four GEMM weights of every layer to float8 with per-channel scales (after `fuse`;
        embeddings, norms and the output head stay in their dtype). One-way."""
        if not self.fused:
            raise ValueError("--quantization fp8 needs the fused GPU path (CUDA and FlashInfer)")
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            for owner, name in (
                (a, "qkv_weight"),
                (a, "o_weight"),
                (m, "gate_up_weight"),
                (m, "down_weight"),
            ):
                setattr(owner, name, fp8.Fp8Weight(getattr(owner, name)))
        torch.cuda.empty_cache()
        widths = (
            self.config["hidden_size"],
            self.config["intermediate_size"],
            self.num_qo_heads * self.head_dim,
        )
        fp8.compile_quantizer(self.inv_freq.device, tuple(sorted(set(widths))))

    def _backbone_fused(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        import flashinfer

        n, d = hidden.shape[0], self.head_dim
        q_dim, kv_dim = self.num_qo_heads * d, self.num_kv_heads * d
        eps = self.config.get("rms_norm_eps", 1e-5)
        layers = self.model.layers
        residual = hidden
        x = flashinfer.rmsnorm(hidden, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            qkv = fp8.linear(x, a.qkv_weight)  # [N, (Hq+2Hkv)D]
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)  # views into qkv's rows
            # In place in qkv (the kernel takes row strides); keys and values stay side by side,
            # so the attention writes both with one scatter (gpu_worker.attention.write_kv).
            flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, self.cos_sin, is_neox=True)
            o = attn.forward(
                i, q.contiguous().view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
            )  # [N, Hq, D]
            h = fp8.linear(o.reshape(n, q_dim), a.o_weight)
            flashinfer.fused_add_rmsnorm(h, residual, layer.post_attention_layernorm.weight, eps)
            h = fp8.linear(flashinfer.silu_and_mul(fp8.linear(h, m.gate_up_weight)), m.down_weight)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            flashinfer.fused_add_rmsnorm(h, residual, nxt, eps)  # residual += h; h = norm(residual)
            x = h
        return x

    # --- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs into the parameters (casting to their dtype and device);
        returns the names loaded. Unknown names raise: a silently ignored weight is a wrong model."""
        # Old checkpoints saved the RoPE buffer.
        return copy_weights(self, weights, skip=lambda name: name.endswith("rotary_emb.inv_freq"))

    def _check_complete(self, loaded: set[str]) -> None:
        expected = {n for n, _ in self.named_parameters(remove_duplicate=False)}
        missing = expected - loaded
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            missing.discard("lm_head.weight")  # tied checkpoints store only the embedding
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    @classmethod
    def from_state_dict(
        cls,
        config: dict[str, Any],
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> LlamaLM:
        lm = cls(config, dtype, device)
        lm._check_complete(lm.load_weights(state_dict.items()))
        return lm.eval()

    @classmethod
    def from_pretrained(
        cls, id_or_dir: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
    ) -> LlamaLM:
        """Load config.json and every *.safetensors shard of a local dir or a Hugging Face repo."""
        from safetensors import safe_open

        path, config = checkpoint_dir(id_or_dir)
        shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors in {path}; convert the checkpoint to safetensors")
        lm = cls(config, dtype, device)
        loaded: set[str] = set()
        for shard in shards:
            # Tensors are read straight onto the target device, one at a time.
            with safe_open(shard, framework="pt", device=str(torch.device(device))) as f:
                loaded |= lm.load_weights((name, f.get_tensor(name)) for name in f.keys())
        lm._check_complete(loaded)
        return lm.eval()

    @classmethod
    @torch.no_grad()
    def dummy(
        cls,
        config: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> LlamaLM:
        """Random weights (normal std 0.02, norm weights 1), deterministic for (seed, device type),
        drawn on the target device in the target dtype."""
        lm = cls(config, dtype, device)
        gen = torch.Generator(device=lm.inv_freq.device).manual_seed(seed)
        for name, p in lm.named_parameters():  # shared (tied) weights come once, in a fixed order
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
        return lm.eval()
