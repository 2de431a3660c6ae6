"""Llama decoder for Orpheus (Llama-3.2-3B backbone), written for the serving runtime.

Based on transformers' `LlamaForCausalLM` (models/llama/modeling_llama.py), built from the shared
Llama pieces in programs/blocks (decoder layers, RMSNorm, llama3 RoPE): same parameter names, so a
published checkpoint or an HF state_dict loads unchanged, and the same arithmetic, so logits match
HF's. This file adds the causal LM around them and its fused GPU path (`fuse`, `quantize_fp8`).

What differs is the calling convention: tokens arrive flattened as rows `[N]` of many requests
with explicit positions, and attention is delegated to the runtime's `attn.forward(layer, q, k, v)`
(paged KV cache), so the whole step can be captured in a CUDA graph: cos/sin are computed from
`pos` on the fly, with no host sync and no Python branch on tensor values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from programs.base import Attention
from programs.blocks import fp8
from programs.blocks.llama import DecoderLayer, Embedding, Factory, Linear, RMSNorm, decoder_stack
from programs.blocks.rope import cos_sin_table, llama3_inv_freq, rope_cos_sin
from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors, random_weights


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
        self.cos_sin = cos_sin_table(self.inv_freq, max_positions)  # [P, D] float32
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
        path, config = checkpoint_dir(id_or_dir)
        lm = cls(config, dtype, device)
        lm._check_complete(load_safetensors(path, device, lm.load_weights))
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
        random_weights(lm, lm.inv_freq.device, seed)
        return lm.eval()
