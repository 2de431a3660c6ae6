"""Chatterbox's T3 for the serving runtime: a Llama backbone over learned text and speech embeddings
with learned positions, the conditioning encoder (speaker projection, perceiver resampler, emotion
projection) and the speech head.

Based on chatterbox-tts 0.1.7's `T3` (models/t3/t3.py, modules/cond_enc.py, modules/perceiver.py, the
reference): the same parameter names (`tfmr.*`, `cond_enc.*`, `text_emb`, `speech_emb`,
`*_pos_emb.emb`, `speech_head`), so the published `t3_cfg.safetensors` loads unchanged, and the same
arithmetic, built from programs/blocks. The backbone's `embed_tokens` (unused: T3 brings its own
embeddings) and the text head (training only) are not loaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.base import Attention
from programs.blocks import fp8
from programs.blocks.llama import DecoderLayer, Embedding, Linear, RMSNorm, decoder_stack, param
from programs.blocks.rope import llama3_inv_freq, rope_cos_sin
from programs.blocks.weights import copy_weights, random_weights

_UNUSED = ("tfmr.embed_tokens.weight", "text_head.weight")


class _Llama(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, head_dim, fk) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5), fk)


class _Positions(nn.Module):
    """LearnedPositionEmbeddings: `emb.weight` [positions, H]."""

    def __init__(self, n: int, dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.emb = Embedding(n, dim, fk)


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.weight, self.bias = param(dim, fk=fk), param(dim, fk=fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-5)


class _CrossAttention(nn.Module):
    """The perceiver's AttentionBlock2: x1 attends (pre-norm, shared norm) over x2, plus x1."""

    def __init__(self, dim: int, heads: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.heads = heads
        self.norm = _LayerNorm(dim, fk)
        self.to_q, self.to_k, self.to_v = (Linear(dim, dim, True, fk) for _ in range(3))
        self.proj_out = Linear(dim, dim, True, fk)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """x1 [B, Q, H], x2 [B, T, H] → [B, Q, H]."""
        b, n1, h = x1.shape
        a, c = self.norm(x1), self.norm(x2)
        q = self.to_q(a).view(b, n1, self.heads, -1).transpose(1, 2)
        k = self.to_k(c).view(b, c.shape[1], self.heads, -1).transpose(1, 2)
        v = self.to_v(c).view(b, c.shape[1], self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n1, h)
        return x1 + self.proj_out(out)


class _Perceiver(nn.Module):
    def __init__(self, queries: int, dim: int, heads: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.pre_attention_query = param(1, queries, dim, fk=fk)
        self.attn = _CrossAttention(dim, heads, fk)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] → [B, queries, H]: the queries attend over h, then over themselves."""
        pre = self.attn(self.pre_attention_query.expand(h.shape[0], -1, -1), h)
        return self.attn(pre, pre)


class _CondEnc(nn.Module):
    def __init__(self, cfg: dict[str, Any], fk: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.spkr_enc = Linear(cfg["speaker_embed_size"], hidden, True, fk)
        self.emotion_adv_fc = Linear(1, hidden, False, fk)
        self.perceiver = _Perceiver(cfg["perceiver_queries"], hidden, cfg["perceiver_heads"], fk)


class T3LM(nn.Module):
    """`state_dict()` keys equal the reference T3's less `_UNUSED`."""

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = cfg = dict(config)
        dev = torch.device(device)
        fk = {"dtype": dtype, "device": dev}
        hidden = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        self.tfmr = _Llama(cfg, self.head_dim, fk)
        self.cond_enc = _CondEnc(cfg, fk)
        self.text_emb = Embedding(cfg["text_tokens_dict_size"], hidden, fk)
        self.speech_emb = Embedding(cfg["speech_tokens_dict_size"], hidden, fk)
        self.text_pos_emb = _Positions(cfg["max_text_tokens"] + 2, hidden, fk)
        self.speech_pos_emb = _Positions(cfg["max_speech_tokens"] + 4, hidden, fk)
        self.speech_head = Linear(hidden, cfg["speech_tokens_dict_size"], False, fk)
        self.register_buffer("inv_freq", llama3_inv_freq(cfg, self.head_dim).to(dev), persistent=False)

    # --- loading ---------------------------------------------------------------------------------
    @classmethod
    def dummy(cls, config: dict[str, Any], dtype: torch.dtype, device: str | torch.device) -> T3LM:
        lm = cls(config, dtype, device)
        random_weights(lm, device, seed=0)
        return lm.eval()

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: str | torch.device) -> T3LM:
        """`t3_cfg.safetensors` of a local checkpoint folder (or the hub's ResembleAI/chatterbox)."""
        from programs.chatterbox.spec import SPECS

        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(
                path, allow_patterns=["t3_cfg.safetensors", "conds.pt", "tokenizer.json"]
            )
        here = os.path.join(os.path.dirname(__file__), "configs", SPECS["chatterbox"]["lm_config"])
        with open(here) as f:
            lm = cls(json.load(f), dtype, device)
        shard = os.path.join(path, "t3_cfg.safetensors")
        from safetensors import safe_open

        with safe_open(shard, framework="pt", device=str(torch.device(device))) as f:
            loaded = copy_weights(lm, ((n, f.get_tensor(n)) for n in f.keys()), lambda n: n in _UNUSED)
        missing = {n for n, _ in lm.named_parameters()} - loaded
        if missing:
            raise ValueError(f"{shard} lacks {sorted(missing)[:5]}")
        return lm.eval()

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """The backbone's linear weights (every layer's q/k/v/o and gate/up/down) to float8 with
        per-output-channel scales (`fp8.Fp8Weight`, `--quantization fp8`): a float8 GEMM gives a
        row the same bits at any row count, so a request's tokens do not depend on its batch.
        Embeddings, norms, the conditioning encoder and the speech head stay in their dtype.
        One-way."""
        linears = []
        for layer in self.tfmr.layers:
            a, m = layer.self_attn, layer.mlp
            linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        cfg = self.config
        widths = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"] * self.head_dim)
        fp8.quantize_linears(linears, widths)

    # --- conditioning (admission, eager) -----------------------------------------------------------
    @torch.inference_mode()
    def cond_rows(
        self, speaker: torch.Tensor, tokens: torch.Tensor, exaggeration: torch.Tensor
    ) -> torch.Tensor:
        """A voice's conditioning rows [2 + queries, H]: speaker [256], prompt speech tokens [T]
        int64 (T >= 1), exaggeration [1] → the speaker projection, the perceiver's rows of the
        prompt tokens' embeddings (plus their learned positions), the emotion projection."""
        enc = self.cond_enc
        spk = enc.spkr_enc(speaker.view(1, -1).to(self.speech_head.weight.dtype))  # [1, H]
        emb = self.speech_emb(tokens) + self.speech_pos_emb.emb.weight[: len(tokens)]  # [T, H]
        prompt = enc.perceiver(emb[None])[0]  # [queries, H]
        emotion = enc.emotion_adv_fc(exaggeration.view(1, 1).to(spk.dtype))  # [1, H]
        return torch.cat([spk, prompt, emotion])

    # --- step (graph-safe) -------------------------------------------------------------------------
    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Rows [N, H] at positions pos [N] → [N, H] after the final norm."""
        cos, sin = rope_cos_sin(self.inv_freq, pos, hidden.dtype)
        return decoder_stack(self.tfmr.layers, self.tfmr.norm, hidden, cos, sin, attn)
