"""Higgs Audio v2's language model for the serving runtime: Llama-3.2-3B with DualFFN layers, audio
codebook embeddings and the 8-codebook audio head.

Based on transformers' `HiggsAudioV2ForConditionalGeneration` (models/higgs_audio_v2, the
reference): the same parameter names (`model.*`, `audio_lm_head`), so the transformers checkpoint
loads unchanged, and bosonai's original names map onto them (`load_weights`); the same arithmetic,
built from programs/blocks.

- Each layer has two feed-forward paths: text rows take `input_layernorm`, `post_attention_layernorm`
  and `mlp`; audio rows `audio_input_layernorm`, `audio_post_attention_layernorm` and `audio_mlp`
  (DualFFN); attention is shared. The per-row flag comes with the rows (`backbone`'s `audio`).
- A text row's input is `embed_tokens[id]`; an audio row's the sum of its 8 codebooks'
  `embed_audio_tokens[code + 1026 k]`. `audio_lm_head` gives all 8 codebooks' logits from one hidden
  state ([8 · 1026, H]).
- On a GPU each layer runs q/k/v as one GEMM and each feed-forward's gate/up as one (`fuse`, at
  load).
- Where the step says where its prompt rows end (`n_text`, a Python int fixed when the step is
  built or captured: prompt rows first, then generated rows, all audio), the generated rows run
  only the audio path, as a static slice: a decode step reads no text feed-forward weights. Prompt
  rows are text but for a cloned voice's clip (audio rows, flagged per row): a prefill runs both
  paths on its prompt rows and `torch.where` keeps each row's own. Otherwise (the flag alone) both
  paths run on every row. Either way a step's shapes never depend on the flag's values (graph-safe).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.base import Attention
from programs.blocks import fp8
from programs.blocks.llama import MLP, DecoderLayer, Embedding, Linear, RMSNorm
from programs.blocks.rope import llama3_inv_freq, rope_cos_sin, rotate_half
from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors, random_weights

# bosonai's original names (boson-ai/higgs-audio, `HiggsAudioModel`) → transformers' (the mapping of
# transformers' convert_higgs_audio_v2_to_hf.py; its partially frozen embedding and head halves are
# concatenated in `load_weights`).
ORIGINAL_NAMES = (
    (r"^audio_codebook_embeddings\.", "model.embed_audio_tokens.embed_audio_tokens."),
    (r"^(embed_tokens|layers|norm)\b", r"model.\1"),
    (r"^audio_decoder_proj\.", ""),
)
_UNUSED = (
    "audio_codebook_weights",
    "rotary_emb.inv_freq",
    "rotary_emb.original_inv_freq",
    "text_lm_head.weight",
)


class DualFFNLayer(DecoderLayer):
    """A Llama layer plus the audio rows' norms and feed-forward, under transformers' names."""

    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: dict[str, Any]) -> None:
        super().__init__(cfg, head_dim, fk)
        eps = cfg.get("rms_norm_eps", self.default_eps)
        self.audio_mlp = MLP(cfg, fk)
        self.audio_input_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)
        self.audio_post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, fk)


class _AudioEmbeddings(nn.Module):
    def __init__(self, n: int, dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.embed_audio_tokens = Embedding(n, dim, fk)


class _Model(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg["vocab_size"], cfg["hidden_size"], fk)
        self.layers = nn.ModuleList(DualFFNLayer(cfg, head_dim, fk) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5), fk)
        n = cfg["num_codebooks"] * cfg["codebook_size"]
        self.embed_audio_tokens = _AudioEmbeddings(n, cfg["hidden_size"], fk)


class HiggsLM(nn.Module):
    """`state_dict()` keys equal the reference's (`model.*`, `audio_lm_head.weight`)."""

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = dict(config)
        cfg = self.config
        dev = torch.device(device)
        fk = {"dtype": dtype, "device": dev}
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.n_codebooks, self.codebook_size = cfg["num_codebooks"], cfg["codebook_size"]
        self.model = _Model(cfg, self.head_dim, fk)
        self.audio_lm_head = Linear(cfg["hidden_size"], self.n_codebooks * self.codebook_size, False, fk)
        self.register_buffer("inv_freq", llama3_inv_freq(cfg, self.head_dim).to(dev), persistent=False)
        offsets = torch.arange(self.n_codebooks, device=dev) * self.codebook_size
        self.register_buffer("offsets", offsets, persistent=False)
        self._qkv: list[torch.Tensor] = []  # `fuse`'s weights (a GPU program fuses at load)
        self._gate_up: list[tuple[torch.Tensor, torch.Tensor]] = []

    # --- inputs (graph-safe) ---------------------------------------------------------------------
    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # [N] → [N, H]

    def audio_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Rows [N, 8] of ids in [0, 1026) → the sum of their codebooks' embeddings [N, H]."""
        table = self.model.embed_audio_tokens.embed_audio_tokens.weight
        return F.embedding(codes + self.offsets, table).sum(1)

    # --- backbone (graph-safe) -------------------------------------------------------------------
    def backbone(
        self,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        audio: torch.Tensor | None,
        attn: Attention,
        n_text: int | None = None,
    ) -> torch.Tensor:
        """Rows [N, H] at positions pos [N] → [N, H] normed. DualFFN's audio rows are audio [N] bool,
        or with `n_text` k the generated rows [k, N) and the prompt rows that audio [k] bool flags
        (`_Dual`)."""
        cos, sin = rope_cos_sin(self.inv_freq, pos, hidden.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
        dual = _Dual(audio, n_text)
        for i, layer in enumerate(self.model.layers):
            x = dual(hidden, layer.input_layernorm, layer.audio_input_layernorm)
            hidden = hidden + self._attention(i, layer.self_attn, x, cos, sin, attn)
            text = partial(self._ffn, i, 0, layer.post_attention_layernorm, layer.mlp)
            sound = partial(self._ffn, i, 1, layer.audio_post_attention_layernorm, layer.audio_mlp)
            hidden = hidden + dual(hidden, text, sound)
        return self.model.norm(hidden)

    def _attention(self, i: int, a, x: torch.Tensor, cos, sin, attn: Attention) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        if self._qkv and x.is_cuda:
            q, k, v = fp8.linear(x, self._qkv[i]).split((hq * d, hkv * d, hkv * d), dim=-1)
        else:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return a.o_proj(attn.forward(i, q, k, v).reshape(n, hq * d))

    def _ffn(self, i: int, which: int, norm: RMSNorm, mlp: MLP, x: torch.Tensor) -> torch.Tensor:
        """One feed-forward path of layer i (which: 0 text, 1 audio) on rows x [n, H] → [n, H]."""
        return self._mlp(i, which, mlp, norm(x))

    def _mlp(self, i: int, which: int, mlp: MLP, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up and x.is_cuda:
            gate, up = fp8.linear(x, self._gate_up[i][which]).chunk(2, dim=-1)
            return mlp.down_proj(F.silu(gate) * up)
        return mlp(x)

    def fuse(self) -> None:
        """Each layer's q/k/v weights and each feed-forward's gate/up weights as one tensor, the
        projections' own weights becoming views of it (no second copy; loading writes through)."""
        layers = self.model.layers
        if any(
            layer.self_attn.q_proj.bias is not None or layer.mlp.gate_proj.bias is not None
            for layer in layers
        ):
            raise ValueError("the fused projections assume no biases")
        self._qkv = [
            _join(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in layers
        ]
        self._gate_up = [
            tuple(_join(m.gate_proj, m.up_proj) for m in (layer.mlp, layer.audio_mlp)) for layer in layers
        ]

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Every layer's attention projections and both feed-forward paths (text and audio) to
        float8 with per-output-channel scales (`--quantization fp8`, `fp8.Fp8Weight`): a float8
        GEMM gives a row the same bits at any row count on a GPU, so a request's rows do not depend
        on its batch. Embeddings, norms and the audio head stay in their dtype. After `fuse`, the
        fused q/k/v and gate/up weights are the ones quantized (the projections' own weights, views
        of them, are dropped). One-way."""
        cfg = self.config
        widths = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"] * self.head_dim)
        linears = []
        for layer in self.model.layers:
            a, mlps = layer.self_attn, (layer.mlp, layer.audio_mlp)
            linears += [a.o_proj, *(m.down_proj for m in mlps)]
            joined = [a.q_proj, a.k_proj, a.v_proj, *(lin for m in mlps for lin in (m.gate_proj, m.up_proj))]
            if not self._qkv:
                linears += joined
                continue
            for lin in joined:  # views of the fused weights, which the fused path alone reads
                del lin.weight
                lin.weight = None
        if self._qkv:
            self._qkv = [fp8.Fp8Weight(w) for w in self._qkv]
            self._gate_up = [(fp8.Fp8Weight(t), fp8.Fp8Weight(a)) for t, a in self._gate_up]
        fp8.quantize_linears(linears, widths)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] → [B, 8, 1026] float32: every codebook's logits, in GEMMs of 64 rows so that a
        row's logits have the same bits whatever the step's row count (`fp8.tiled_linear`)."""
        logits = fp8.tiled_linear(hidden, self.audio_lm_head.weight)
        return logits.float().view(hidden.shape[0], self.n_codebooks, self.codebook_size)

    # --- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """(name, tensor) pairs in transformers' names or bosonai's original ones (ORIGINAL_NAMES;
        the halves of a partially frozen `embed_tokens` or `audio_lm_head` are concatenated)."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        named = []
        for name, t in weights:
            for part in ("embedding_frozen", "embedding_trainable", "linear_frozen", "linear_trainable"):
                if f".{part}." in name:
                    halves.setdefault(name.replace(f".{part}", ""), {})[part] = t
                    break
            else:
                named.append((name, t))
        for name, parts in halves.items():
            order = sorted(parts, key=lambda p: "trainable" in p)  # frozen rows first
            named.append((name, torch.cat([parts[p] for p in order])))
        return copy_weights(self, ((_rename(n), t) for n, t in named), skip=lambda n: n.endswith(_UNUSED))

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device: str | torch.device) -> HiggsLM:
        """config.json + *.safetensors of a Higgs Audio v2 checkpoint (transformers' or bosonai's)."""
        path, config = checkpoint_dir(id_or_dir)
        if "text_config" in config:  # bosonai's layout: the Llama config inside, audio keys beside it
            config = original_config(config)
        lm = cls(config, dtype, device)
        missing = {n for n, _ in lm.named_parameters()} - load_safetensors(path, device, lm.load_weights)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        return lm.eval()

    @classmethod
    @torch.no_grad()
    def dummy(
        cls, config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int = 0
    ) -> HiggsLM:
        """Random weights (normal std 0.02, norm weights 1), deterministic for (seed, device type)."""
        lm = cls(config, dtype, device)
        random_weights(lm, device, seed)
        return lm.eval()


class _Dual:
    """DualFFN's choice of path per row. With `n_text` k (a Python int: rows [0, k) are prompt rows,
    the rest generated, audio) the generated rows take only the audio path, as a static slice, and
    the prompt rows the text path, or where `audio` [k] bool flags a prompt row (a cloned voice's
    clip), the audio path (both paths then run on the prompt rows and `torch.where` keeps each
    row's own). Without `n_text`, both paths run on every row and `audio` [N] bool keeps each row's
    own."""

    def __init__(self, audio: torch.Tensor | None, n_text: int | None) -> None:
        if n_text is None and audio is None:
            raise ValueError("DualFFN needs the audio flag or where the prompt rows end")
        self.flag = None if audio is None else audio[:, None]  # [N, 1] or [k, 1]
        self.k = n_text

    def __call__(self, x: torch.Tensor, text: Callable, audio: Callable) -> torch.Tensor:
        """x [N, H] → [N, H]: text(x) at text rows, audio(x) at audio rows."""
        k = self.k
        if k is None:
            return torch.where(self.flag, audio(x), text(x))
        if k == 0:
            return audio(x)
        head = x[:k]
        first = text(head) if self.flag is None else torch.where(self.flag, audio(head), text(head))
        return first if k >= x.shape[0] else torch.cat([first, audio(x[k:])])


def _join(*linears: Linear) -> torch.Tensor:
    """The weights of `linears` concatenated by rows; each linear's weight becomes its rows' view."""
    joined = torch.cat([lin.weight for lin in linears])
    lo = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = joined[lo : lo + n]
        lo += n
    return joined


def _rename(name: str) -> str:
    if name.startswith(("model.", "audio_lm_head.")):
        return name
    for pattern, replacement in ORIGINAL_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def original_config(config: dict[str, Any]) -> dict[str, Any]:
    """bosonai's config.json (`HiggsAudioConfig`: `text_config` + audio keys) → transformers' keys."""
    text = config["text_config"]
    keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings", "attention_bias", "mlp_bias",
    )  # fmt: skip
    out = {k: text[k] for k in keys if k in text}
    out["num_codebooks"] = config["audio_num_codebooks"]
    out["codebook_size"] = config["audio_codebook_size"] + 2  # the stream's bos and eos ids
    return out
