"""Qwen3-TTS's language model for the serving runtime: the talker over frames and the code predictor.

Based on qwen-tts' `Qwen3TTSTalkerForConditionalGeneration` (qwen_tts/core/models/
modeling_qwen3_tts.py, the reference): the same parameter names under `talker.` (so the published
safetensors load unchanged; a Base checkpoint's `speaker_encoder.*` is skipped) and the same
arithmetic, built from the shared pieces of programs/blocks.

- Talker: Qwen3 layers (QK-norm) over the paged KV cache with MRoPE (sections over the head's
  frequencies); a speech row has one position for all three rows, which makes it plain RoPE.
  Inputs are embeddings: text rows are `text_projection(text_embedding[id])` (an MLP from the text
  width to the talker's), codec rows `codec_embedding[id]` (3072 ids: 2048 codes, then specials),
  and each generated frame's input is the sum of its 16 codebooks' embeddings plus the frame's text
  column (the caller's: the next text row, then the tts pad row once the text runs out).
  `codec_head` gives codebook 0's logits over the codec vocabulary.
- Code predictor: per frame, a 16-position sequence: position 0 the talker's last hidden state,
  position 1 codebook 0's talker embedding, position k ≥ 2 codebook k-1's
  `code_predictor.model.codec_embedding[k-2]`, all through `small_to_mtp_projection` (a linear
  layer when the widths differ, else none); `lm_head[k-1]` at position k gives codebook k. It runs
  in `predict`, one position at a time over a local KV cache with fixed shapes, so it can be captured.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.base import Attention, Sampler
from programs.blocks import fp8
from programs.blocks.llama import Embedding, Linear, RMSNorm, decoder_stack
from programs.blocks.qwen3 import Qwen3DecoderLayer, mrope_cos_sin, mrope_rows
from programs.blocks.rope import cos_sin_table, llama3_inv_freq, rope_cos_sin, rope_settings
from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors, random_weights


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`; on a GPU as one fused kernel (torch.rms_norm: the same normalization, rounded once
    in fp32 rather than cast back before the weight), where the layer-by-layer step is launch-bound."""
    if x.is_cuda:
        return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return norm(x)


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _joint(*linears: nn.Module) -> torch.Tensor:
    """The weights of bias-free linears [N_i, K] stacked into one [sum N_i, K] for a single GEMM;
    each linear's weight becomes a view of its rows, so the parts cost no memory of their own."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("joint projections assume no biases")
    joint = torch.cat([lin.weight for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(joint[start : start + n], requires_grad=False)
        start += n
    return joint


def _qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, attn: nn.Module, d: int, cos_sin: torch.Tensor
) -> None:
    """In place in rows q [N, Hq D] and k [N, Hkv D] (views into a q/k/v GEMM's output): each head's
    RMSNorm (`q_norm`, `k_norm`), then rotate-half RoPE at positions pos [N]."""
    import flashinfer

    n = q.shape[0]
    for rows, norm in ((q, attn.q_norm), (k, attn.k_norm)):
        heads = rows.view(n, -1, d)  # [N, H, D] with the GEMM output's row stride
        flashinfer.rmsnorm(heads, norm.weight, norm.eps, out=heads)
    flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cos_sin, is_neox=True)


class _Stack(nn.Module):
    """`layers.*` and `norm` of a Qwen3 decoder, under the reference's names."""

    def __init__(self, cfg: dict[str, Any], fk: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = _head_dim(cfg)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, self.head_dim, fk) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), fk)


class _TalkerModel(_Stack):
    def __init__(self, cfg: dict[str, Any], fk: dict[str, Any]) -> None:
        super().__init__(cfg, fk)
        self.codec_embedding = Embedding(cfg["vocab_size"], cfg["hidden_size"], fk)
        self.text_embedding = Embedding(cfg["text_vocab_size"], cfg["text_hidden_size"], fk)


class _ResizeMLP(nn.Module):
    """`text_projection`: linear_fc2(act(linear_fc1(x))), both with bias."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.linear_fc1 = Linear(d_in, d_mid, True, fk)
        self.linear_fc2 = Linear(d_mid, d_out, True, fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class _PredictorModel(_Stack):
    def __init__(self, cfg: dict[str, Any], talker_hidden: int, fk: dict[str, Any]) -> None:
        super().__init__(cfg, fk)
        n = cfg["num_code_groups"] - 1
        self.codec_embedding = nn.ModuleList(
            Embedding(cfg["vocab_size"], talker_hidden, fk) for _ in range(n)
        )


class _CodePredictor(nn.Module):
    def __init__(self, cfg: dict[str, Any], talker_hidden: int, fk: dict[str, Any]) -> None:
        super().__init__()
        hidden, n = cfg["hidden_size"], cfg["num_code_groups"] - 1
        self.model = _PredictorModel(cfg, talker_hidden, fk)
        self.lm_head = nn.ModuleList(Linear(hidden, cfg["vocab_size"], False, fk) for _ in range(n))
        # The reference's nn.Identity when the talker and the predictor have one width.
        self.small_to_mtp_projection = (
            Linear(talker_hidden, hidden, True, fk) if hidden != talker_hidden else None
        )

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)


class Qwen3TtsLM(nn.Module):
    """`state_dict()` keys equal the reference talker's; the checkpoint's names carry `talker.`."""

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.config = dict(config)
        tc = self.talker_config = dict(config["talker_config"])
        pc = self.predictor_config = dict(tc["code_predictor_config"])
        self.n_codebooks: int = tc["num_code_groups"]
        self.vocab_size: int = tc["vocab_size"]
        self.hidden_size: int = tc["hidden_size"]
        dev = torch.device(device)
        fk = {"dtype": dtype, "device": dev}
        self.model = _TalkerModel(tc, fk)
        self.text_projection = _ResizeMLP(
            tc["text_hidden_size"], tc["text_hidden_size"], tc["hidden_size"], fk
        )
        self.codec_head = Linear(tc["hidden_size"], tc["vocab_size"], False, fk)
        self.code_predictor = _CodePredictor(pc, tc["hidden_size"], fk)
        _, scaling = rope_settings(tc)
        rows = mrope_rows(scaling["mrope_section"], bool(scaling.get("interleaved", False)), dev)
        self.register_buffer("mrope_rows", rows, persistent=False)  # [D/2] position row per frequency
        self.register_buffer("inv_freq", llama3_inv_freq(tc, self.model.head_dim).to(dev), persistent=False)
        # Predictor RoPE (plain) for positions 0..C-1, fp32 angles cast to the weights' dtype.
        inv = llama3_inv_freq(pc, self.code_predictor.model.head_dim).to(dev)
        cos, sin = rope_cos_sin(inv, torch.arange(self.n_codebooks, device=dev), dtype)
        self.register_buffer("predictor_cos", cos, persistent=False)  # [C, Dp]
        # rotate_half(x) * sin == x.roll(D/2) * signed (the first half of sin negated): one kernel
        # where rotate_half takes two (a negation and a concatenation), bit for bit the same.
        half = sin.shape[-1] // 2
        signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("predictor_sin_signed", signed, persistent=False)  # [C, Dp]
        # The same angles in float32, cos then sin (FlashInfer's layout), for the fused path's kernel.
        self.register_buffer("predictor_cos_sin", cos_sin_table(inv, self.n_codebooks), persistent=False)
        self.register_buffer(
            "predictor_positions", torch.arange(self.n_codebooks, device=dev), persistent=False
        )
        self._position = None  # fused.position_step (compiled) once compile_predictor is called
        self._qkv: list[torch.Tensor] | None = None  # fuse_predictor's weights, built at first use
        self._gate_up: list[torch.Tensor] = []
        self.fused = False  # FlashInfer's kernels on a GPU: see fuse()

    # --- inputs (graph-safe) ---------------------------------------------------------------------
    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Text ids [N] → projected text rows [N, H] (the talker's text track)."""
        return self.text_projection(self.model.text_embedding(ids))

    def codec_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids [N] (codes, or the think / language / speaker / pad / bos specials) → [N, H]."""
        return self.model.codec_embedding(ids)

    def frame_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Frames [N, C] of codes → [N, H]: the sum of codebook 0's talker embedding and codebook
        k's `code_predictor.model.codec_embedding[k-1]`, summed as one reduction as the reference."""
        tables = self.code_predictor.model.codec_embedding
        parts = [self.model.codec_embedding(codes[:, 0])]
        parts += [tables[k - 1](codes[:, k]) for k in range(1, self.n_codebooks)]
        return torch.stack(parts, dim=1).sum(1)

    # --- talker (graph-safe) ---------------------------------------------------------------------
    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Rows [N, H] at positions pos [N] (all three MRoPE rows alike) or [3, N] → [N, H] normed."""
        if self.fused and pos.dim() == 1:
            return self._backbone_fused(hidden, pos, attn)
        cos, sin = mrope_cos_sin(self.inv_freq, pos, self.mrope_rows, hidden.dtype)
        return decoder_stack(self.model.layers, self.model.norm, hidden, cos, sin, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()  # [B, H] → [B, V] codebook 0 (and the specials)

    # --- code predictor (graph-safe) -------------------------------------------------------------
    def predict(self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler) -> torch.Tensor:
        """hidden [B, H] talker, c0 [B] → frame [B, C] int64; codebook k drawn with salt k."""
        cp = self.code_predictor
        m, heads = cp.model, cp.lm_head
        b, c, dh = hidden.shape[0], self.n_codebooks, m.head_dim
        hkv = m.layers[0].self_attn.num_kv_heads
        shape = (len(m.layers), b, hkv, c, dh)  # [L, B, Hkv, C, D] local KV cache
        # The one-shape step reads every slot (masked): zeros, never uninitialized memory.
        alloc = hidden.new_empty if self._position is None else hidden.new_zeros
        keys, values = alloc(shape), alloc(shape)
        codes = [c0]
        if self._qkv is None:
            self.fuse_predictor()
        for t in range(c):
            if t == 0:
                x = cp.project(hidden)  # position 0: the talker's state
            elif t == 1:
                x = cp.project(self.model.codec_embedding(c0))
            else:
                x = cp.project(m.codec_embedding[t - 2](codes[-1]))
            norm = m.norm
            if self._position is not None:  # positions as device tensors: one function for all (fused.py)
                h, keys, values = self._position(self, x, self.predictor_positions[t], keys, values)
            elif self.fused:  # the final norm included
                h, norm = self._predictor_position_fused(x, t, keys, values), None
            else:
                h = self._predictor_position(x, t, keys, values)
            if t > 0:
                logits = heads[t - 1](h if norm is None else norm(h)).float()  # [B, V]
                codes.append(sample(logits, t))
        return torch.stack(codes, dim=1)  # [B, C]

    def _predictor_position(
        self, x: torch.Tensor, t: int, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """One predictor position x [B, Hp] through its layers; writes position t of the local cache.
        The step is dozens of tiny kernels per codebook, so it runs each layer's projections as two
        GEMMs (q/k/v together, gate/up together: `fuse_predictor`) and attention with grouped KV."""
        m = self.code_predictor.model
        b, dh = x.shape[0], m.head_dim
        cos, sin = self.predictor_cos[t], self.predictor_sin_signed[t]  # [D]
        h = x
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            hq, hkv = a.num_heads, a.num_kv_heads
            qkv = fp8.linear(_norm(layer.input_layernorm, h), self._qkv[i])  # [B, (Hq + 2 Hkv) D]
            q, k, v = qkv.split((hq * dh, hkv * dh, hkv * dh), dim=-1)
            q = _norm(a.q_norm, q.view(b, hq, dh))
            k = _norm(a.k_norm, k.view(b, hkv, dh))
            q = q * cos + q.roll(dh // 2, dims=-1) * sin
            keys[i, :, :, t] = k * cos + k.roll(dh // 2, dims=-1) * sin
            values[i, :, :, t] = v.view(b, hkv, dh)
            kk, vv = keys[i, :, :, : t + 1], values[i, :, :, : t + 1]  # [B, Hkv, t+1, D]
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], kk, vv, enable_gqa=hq != hkv
            )  # [B, Hq, 1, D]
            h = h + a.o_proj(o.reshape(b, hq * dh))
            gate, up = fp8.linear(_norm(layer.post_attention_layernorm, h), self._gate_up[i]).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(F.silu(gate) * up)
        return h

    def _predictor_position_fused(
        self, x: torch.Tensor, t: int, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """`_predictor_position` then the final norm, in FlashInfer's kernels (see `fuse`): the
        residual adds fused with the norms, SiLU-and-mul, and between the q/k/v GEMM and o_proj one
        Triton kernel (QK-norm, RoPE, the cache's slot t, attention: blocks/depth_attention.py).
        Eight kernels a layer where the eager position takes about twenty-five."""
        import flashinfer

        from programs.blocks.depth_attention import depth_attention

        m = self.code_predictor.model
        layers = m.layers
        residual = x.clone()  # fused_add_rmsnorm adds into it in place
        h = flashinfer.rmsnorm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            a = layer.self_attn
            qkv = fp8.linear(h, self._qkv[i])  # [B, (Hq + 2 Hkv) D]
            qn, kn = a.q_norm, a.k_norm  # one eps: both from the config's rms_norm_eps
            o = depth_attention(
                qkv, qn.weight, kn.weight, qn.eps, self.predictor_cos_sin, keys[i], values[i], t
            )
            h = a.o_proj(o)  # o [B, Hq D]
            pn = layer.post_attention_layernorm
            flashinfer.fused_add_rmsnorm(h, residual, pn.weight, pn.eps)  # residual += h; h = norm
            h = layer.mlp.down_proj(flashinfer.silu_and_mul(fp8.linear(h, self._gate_up[i])))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            flashinfer.fused_add_rmsnorm(h, residual, nxt.weight, nxt.eps)
        return h

    def _backbone_fused(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        """`backbone` for one position per row, in FlashInfer's kernels (see `fuse`)."""
        import flashinfer

        n, d = hidden.shape[0], self.model.head_dim
        layers = self.model.layers
        residual = hidden.clone()
        ln = layers[0].input_layernorm
        h = flashinfer.rmsnorm(hidden, ln.weight, ln.eps)
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            hq, hkv = a.num_heads, a.num_kv_heads
            qkv = fp8.linear(h, a.qkv_weight)  # [N, (Hq + 2 Hkv) D]
            q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
            _qk_norm_rope(q, k, pos, a, d, self._talker_cos_sin)
            o = attn.forward(i, q.contiguous().view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d))
            h = a.o_proj(o.reshape(n, hq * d))
            pn = layer.post_attention_layernorm
            flashinfer.fused_add_rmsnorm(h, residual, pn.weight, pn.eps)
            h = mlp.down_proj(flashinfer.silu_and_mul(fp8.linear(h, mlp.gate_up_weight)))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            flashinfer.fused_add_rmsnorm(h, residual, nxt.weight, nxt.eps)
        return h

    @torch.no_grad()
    def fuse(self, max_positions: int) -> None:
        """Run the talker and the predictor in FlashInfer's kernels on a GPU: q/k/v and gate/up as
        one GEMM each (the separate weights become views of the joint ones, so both paths stay and
        no memory is added), RMSNorm fused with the residual add, QK-norm and RoPE (from float32
        cos/sin tables) in place, SiLU-and-mul; the predictor's QK-norm, RoPE, cache write and
        attention as one Triton kernel (blocks/depth_attention.py). A decode step at small batches
        is made of its kernel launches; this cuts the talker's from about forty a layer to
        thirteen, the predictor's from about twenty-five to eight. Same math as the eager layers in
        another rounding order (bf16 tolerance, not bitwise); every kernel is row-wise, so a row's
        bits do not depend on its batch. Rows of fp16/bf16 only."""
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            a.qkv_weight = _joint(a.q_proj, a.k_proj, a.v_proj)
            mlp.gate_up_weight = _joint(mlp.gate_proj, mlp.up_proj)
        self.fuse_predictor()
        self._talker_cos_sin = cos_sin_table(self.inv_freq, max_positions)
        self.fused = True

    def compile_predictor(self, enabled: bool = True, compiler=None) -> None:
        """Run the predictor's positions through `fused.position_step` under `compiler` (default:
        torch.compile with a dynamic batch), or (enabled False) through the eager step again."""
        from programs.qwen3_tts.fused import position_step

        if not enabled:
            self._position = None
            return
        compiler = compiler or (lambda fn: torch.compile(fn, dynamic=True))
        self._position = compiler(position_step)

    def fuse_predictor(self) -> None:
        """The predictor's q/k/v and gate/up weights joint (`_joint`; biases: none)."""
        layers = self.code_predictor.model.layers
        self._qkv = [_joint(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in layers)]
        self._gate_up = [_joint(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]

    # --- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """(name, tensor) pairs with the checkpoint's names (`talker.*`); a Base checkpoint's
        `speaker_encoder.*` belongs to voice cloning and is passed over."""
        talker = ((n.removeprefix("talker."), t) for n, t in weights if not n.startswith("speaker_encoder."))
        # In place: once joint (`_joint`), the separate weights are views of the joint ones.
        return copy_weights(self, talker, skip=lambda n: False)

    def _check_complete(self, loaded: set[str]) -> None:
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device: str | torch.device) -> Qwen3TtsLM:
        """config.json + model*.safetensors of a Qwen3-TTS checkpoint (a local dir or the hub id)."""
        path, config = checkpoint_dir(id_or_dir)
        lm = cls(config, dtype, device)
        lm._check_complete(load_safetensors(path, device, lm.load_weights))
        return lm.eval()

    @classmethod
    @torch.no_grad()
    def dummy(
        cls, config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int = 0
    ) -> Qwen3TtsLM:
        """Random weights (normal std 0.02, norm weights 1, biases 0), deterministic for (seed, device type)."""
        lm = cls(config, dtype, device)
        random_weights(lm, device, seed)
        return lm.eval()
