"""CSM-1B's language model for the serving runtime: a Llama backbone over frames and a depth decoder.

Based on transformers' `CsmForConditionalGeneration` (models/csm/modeling_csm.py and
generation_csm.py): the same parameter names (so sesame/csm-1b's safetensors load unchanged, the
codec's `codec_model.*` aside) and the same arithmetic, built from the shared Llama pieces of
programs/blocks.

- Backbone: a frame row is embedded as the sum of its 32 codebook embeddings
  (`embed_audio_tokens[code + 2051 * k]`), a text row as `embed_text_tokens[id]`; Llama layers over
  the paged KV cache; `lm_head` gives codebook 0's logits.
- Depth decoder: per frame, a 32-position sequence: position 0 is the backbone's last hidden
  state, position k ≥ 1 codebook k-1's embedding (shared with the backbone), both through
  `inputs_embeds_projector`; `codebooks_head[k-1]` at position k gives codebook k. It runs in
  `depth`, one position at a time over a local KV cache with fixed shapes, so it can be captured.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.base import Attention, Sampler
from programs.blocks.llama import DecoderLayer, Embedding, Linear, RMSNorm, decoder_stack, param
from programs.blocks.rope import llama3_inv_freq, rope_cos_sin, rotate_half
from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors, random_weights
from programs.csm.spec import TEXT_MARK


class _Stack(nn.Module):
    """`layers.*` and `norm` of a Llama decoder, under HF's names."""

    def __init__(self, cfg: dict[str, Any], fk: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.head_dim, fk) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5), fk)


class _AudioEmbeddings(nn.Module):
    def __init__(self, n: int, dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.embed_audio_tokens = Embedding(n, dim, fk)


class _DepthModel(_Stack):
    def __init__(self, cfg: dict[str, Any], tied: nn.Parameter, fk: dict[str, Any]) -> None:
        super().__init__(cfg, fk)
        self.embed_tokens = Embedding(1, 1, fk)
        self.embed_tokens.weight = tied  # tie_codebooks_embeddings: the backbone's audio embeddings
        self.inputs_embeds_projector = Linear(cfg["backbone_hidden_size"], cfg["hidden_size"], False, fk)


class _CodebooksHead(nn.Module):
    def __init__(self, n: int, dim: int, vocab: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.weight = param(n, dim, vocab, fk=fk)  # [C-1, Hd, V]


class _DepthDecoder(nn.Module):
    def __init__(self, cfg: dict[str, Any], tied: nn.Parameter, fk: dict[str, Any]) -> None:
        super().__init__()
        self.model = _DepthModel(cfg, tied, fk)
        self.codebooks_head = _CodebooksHead(
            cfg["num_codebooks"] - 1, cfg["hidden_size"], cfg["vocab_size"], fk
        )


class _Backbone(_Stack):
    def __init__(self, cfg: dict[str, Any], fk: dict[str, Any]) -> None:
        super().__init__(cfg, fk)
        self.embed_tokens = _AudioEmbeddings(cfg["num_codebooks"] * cfg["vocab_size"], cfg["hidden_size"], fk)


class CsmLM(nn.Module):
    """`state_dict()` keys equal `CsmForConditionalGeneration`'s without `codec_model.*`."""

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = dict(config)
        self.depth_config = dict(config["depth_decoder_config"])
        self.num_codebooks: int = config["num_codebooks"]
        self.vocab_size: int = config["vocab_size"]
        self.text_vocab_size: int = config["text_vocab_size"]
        self.hidden_size: int = config["hidden_size"]
        fk = {"dtype": dtype, "device": torch.device(device)}
        self.embed_text_tokens = Embedding(self.text_vocab_size, self.hidden_size, fk)
        self.backbone_model = _Backbone(config, fk)
        self.lm_head = Linear(self.hidden_size, self.vocab_size, False, fk)
        tied = self.backbone_model.embed_tokens.embed_audio_tokens.weight
        self.depth_decoder = _DepthDecoder(self.depth_config, tied, fk)
        dev = torch.device(device)
        offsets = torch.arange(self.num_codebooks, device=dev) * self.vocab_size
        self.register_buffer("audio_offsets", offsets, persistent=False)  # [C] int64
        # Depth RoPE for positions 0..C-1, fp32 angles cast to the weights' dtype as HF does.
        d = self.depth_decoder.model
        inv = llama3_inv_freq(self.depth_config, d.head_dim).to(dev)
        cos, sin = rope_cos_sin(inv, torch.arange(self.num_codebooks, device=dev), dtype)
        self.register_buffer("depth_cos", cos, persistent=False)  # [C, Dd]
        self.register_buffer("depth_sin", sin, persistent=False)
        self.register_buffer(
            "inv_freq", llama3_inv_freq(config, self.backbone_model.head_dim).to(dev), persistent=False
        )

    # --- backbone (graph-safe) -------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [N, C] int64 (frames, or text rows marked in column 1) → [N, H]."""
        is_text = ids[:, 1] == TEXT_MARK  # [N]
        text = self.embed_text_tokens(torch.where(is_text, ids[:, 0], 0))  # [N, H]
        codes = torch.where(is_text[:, None], 0, ids)  # [N, C]
        audio = self.backbone_model.embed_tokens.embed_audio_tokens(codes + self.audio_offsets).sum(dim=1)
        return torch.where(is_text[:, None], text, audio)

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.inv_freq, pos, hidden.dtype)
        return decoder_stack(self.backbone_model.layers, self.backbone_model.norm, hidden, cos, sin, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, H] → [B, V] codebook 0

    # --- depth decoder (graph-safe) --------------------------------------------------------------
    def depth(self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler) -> torch.Tensor:
        """hidden [B, H] backbone, c0 [B] → frame [B, C] int64; codebook k drawn with salt k."""
        m, heads = self.depth_decoder.model, self.depth_decoder.codebooks_head.weight
        b, c, dh = hidden.shape[0], self.num_codebooks, m.head_dim
        n_layers = len(m.layers)
        attn0 = m.layers[0].self_attn
        hq, hkv = attn0.num_heads, attn0.num_kv_heads
        keys = hidden.new_empty(n_layers, b, hkv, c, dh)  # [L, B, Hkv, C, D] local KV cache
        values = hidden.new_empty(n_layers, b, hkv, c, dh)
        codes = [c0]
        x = m.inputs_embeds_projector(hidden)  # position 0: the backbone state
        for t in range(c):
            if t > 0:
                emb = m.embed_tokens(codes[-1] + (t - 1) * self.vocab_size)  # [B, H]
                x = m.inputs_embeds_projector(emb)
            cos, sin = self.depth_cos[t], self.depth_sin[t]  # [D]
            h = x  # [B, Hd]
            for i, layer in enumerate(m.layers):
                a = layer.self_attn
                y = layer.input_layernorm(h)
                q = a.q_proj(y).view(b, hq, dh)
                k = a.k_proj(y).view(b, hkv, dh)
                v = a.v_proj(y).view(b, hkv, dh)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                keys[i, :, :, t] = k
                values[i, :, :, t] = v
                kk = keys[i, :, :, : t + 1].repeat_interleave(hq // hkv, dim=1)  # [B, Hq, t+1, D]
                vv = values[i, :, :, : t + 1].repeat_interleave(hq // hkv, dim=1)
                o = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv)  # [B, Hq, 1, D]
                h = h + a.o_proj(o.reshape(b, hq * dh))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            if t == 0:
                continue  # position 0 predicts nothing: codebook 0 came from the backbone
            logits = (m.norm(h) @ heads[t - 1]).float()  # [B, V]
            codes.append(sample(logits, t))
            if t == c - 1:
                break
        return torch.stack(codes, dim=1)  # [B, C]

    # --- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        # Mimi's weights (codec_model.*) belong to the codec_worker; old checkpoints saved RoPE buffers.
        return copy_weights(
            self, weights, skip=lambda n: n.startswith("codec_model.") or n.endswith("rotary_emb.inv_freq")
        )

    def _check_complete(self, loaded: set[str]) -> None:
        missing = {n for n, _ in self.named_parameters(remove_duplicate=False)} - loaded
        tied = {
            "depth_decoder.model.embed_tokens.weight",
            "backbone_model.embed_tokens.embed_audio_tokens.weight",
        }
        if tied & loaded:
            missing -= tied  # tied: a checkpoint may store either name
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device: str | torch.device) -> CsmLM:
        """config.json + *.safetensors of sesame/csm-1b (a local dir or the hub id)."""
        path, config = checkpoint_dir(id_or_dir)
        lm = cls(config, dtype, device)
        keep = lambda name: not name.startswith("codec_model.")  # noqa: E731 (Mimi: the codec_worker's)
        lm._check_complete(load_safetensors(path, device, lm.load_weights, keep))
        return lm.eval()

    @classmethod
    @torch.no_grad()
    def dummy(
        cls, config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int = 0
    ) -> CsmLM:
        """Random weights (normal std 0.02, norm weights 1), deterministic for (seed, device type)."""
        lm = cls(config, dtype, device)
        random_weights(lm, device, seed)
        return lm.eval()
