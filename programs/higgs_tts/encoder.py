"""Higgs Audio v2 tokenizer's encoder (24 kHz audio → codes [T, 8] at 25 Hz), for voice cloning.

The network is the reference's encode path (transformers' `HiggsAudioV2TokenizerModel.encode`)
under its parameter names, so the tokenizer checkpoint loads unchanged:

- semantic features: the clip resampled to 16 kHz (windowed-sinc interpolation, a Hann window over
  6 zero crossings, cutoff 0.99 of the lower Nyquist rate), padded by 160 samples each side, through
  the HuBERT teacher (`semantic_model`: 7 convolutions, the first group-normed, 320 samples a frame;
  a projection; a grouped positional convolution; post-norm transformer layers); the mean of its
  hidden states (the first layer's input and every layer's output), every second frame (25 Hz), then
  `encoder_semantic` (convolutions with ELU residual units);
- acoustic features: the DAC encoder (`acoustic_encoder`: a kernel-7 conv, blocks of residual
  units of dilations 1, 3, 9 + Snake + a strided conv, then Snake and a kernel-3 conv), the clip
  padded by half a frame each side when the encoder's frames would not match the semantic ones;
- both concatenated, through `fc`, then the residual quantizer's first 8 codebooks: each picks the
  nearest code of `project_in(residual)` and subtracts its `project_out`.

Clips are encoded one at a time: the first convolution's group norm and the transformer's attention
span the whole clip, so a padded batch would change every frame.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks.audio import resample
from programs.higgs_tts import spec as h
from programs.higgs_tts.codec import Snake, load_parts

SEMANTIC_PAD = 160  # samples at 16 kHz on each side of the clip before HuBERT


# --- HuBERT (the semantic teacher) ---------------------------------------------------------------
class _ConvLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, bias: bool, norm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, bias=bias)
        self.layer_norm = nn.GroupNorm(c_out, c_out) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return F.gelu(self.layer_norm(x) if self.layer_norm is not None else x)


class _FeatureEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dims, bias = list(cfg["conv_dim"]), cfg["conv_bias"]
        self.conv_layers = nn.ModuleList(
            _ConvLayer(dims[i - 1] if i else 1, dims[i], k, s, bias, norm=i == 0)
            for i, (k, s) in enumerate(zip(cfg["conv_kernel"], cfg["conv_stride"], strict=True))
        )


class _FeatureProjection(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg["conv_dim"][-1], eps=cfg["layer_norm_eps"])
        self.projection = nn.Linear(cfg["conv_dim"][-1], cfg["hidden_size"])


class _PositionalConv(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        k = cfg["num_conv_pos_embeddings"]
        d = cfg["hidden_size"]
        self.conv = nn.Conv1d(d, d, k, padding=k // 2, groups=cfg["num_conv_pos_embedding_groups"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] → [B, T, D] (an even kernel's extra last output dropped)."""
        y = self.conv(x.transpose(1, 2))[..., : x.shape[1]]
        return F.gelu(y).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        w = torch.softmax(q @ k.transpose(2, 3) * q.shape[-1] ** -0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, t, d))


class _FeedForward(nn.Module):
    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(d, inner)
        self.output_dense = nn.Linear(inner, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class _Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.attention = _Attention(d, cfg["num_attention_heads"])
        self.layer_norm = nn.LayerNorm(d, eps=eps)
        self.feed_forward = _FeedForward(d, cfg["intermediate_size"])
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.pos_conv_embed = _PositionalConv(cfg)
        self.layer_norm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


HUBERT_DEFAULTS = {
    "conv_dim": [512] * 7,
    "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_stride": [5, 2, 2, 2, 2, 2, 2],
    "conv_bias": False,
    "num_conv_pos_embeddings": 128,
    "num_conv_pos_embedding_groups": 16,
    "layer_norm_eps": 1e-5,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
}  # transformers' HubertConfig defaults (HuBERT base), for the keys a config leaves out


class Hubert(nn.Module):
    """HuBERT (post-norm, group-normed first convolution) → the mean of its hidden states."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        cfg = {**HUBERT_DEFAULTS, **cfg}
        if cfg.get("feat_extract_norm", "group") != "group" or cfg.get("do_stable_layer_norm", False):
            raise ValueError("the semantic model is HuBERT with a group-normed first convolution, post-norm")
        self.feature_extractor = _FeatureEncoder(cfg)
        self.feature_projection = _FeatureProjection(cfg)
        self.encoder = _Encoder(cfg)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, S] at 16 kHz → the mean of the hidden states [B, T, D] (T = frames of 320)."""
        x = audio[:, None]
        for layer in self.feature_extractor.conv_layers:
            x = layer(x)
        proj = self.feature_projection
        x = proj.projection(proj.layer_norm(x.transpose(1, 2)))
        enc = self.encoder
        x = enc.layer_norm(x + enc.pos_conv_embed(x))
        total = x
        for layer in enc.layers:
            x = layer(x)
            total = total + x
        return total / (len(enc.layers) + 1)


# --- the semantic encoder and the DAC encoder ------------------------------------------------------
class _EluUnit(nn.Module):
    def __init__(self, c: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(
            c, c, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation, bias=False
        )
        self.conv2 = nn.Conv1d(c, c, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class _SemanticBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, cfg: dict[str, Any]) -> None:
        super().__init__()
        k = cfg["unit_kernel_size"]
        self.res_units = nn.ModuleList(_EluUnit(c_in, k, d) for d in cfg["block_dilations"])
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    """HuBERT features [B, D, T] → [B, D', T] (`encoder_semantic`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        d, k = cfg["semantic_model_config"]["hidden_size"], cfg["kernel_size"]
        self.conv = nn.Conv1d(d, d, k, 1, k // 2, bias=False)
        widths = [d] + [int(d * r) for r in cfg["channel_ratios"]]
        self.conv_blocks = nn.ModuleList(
            _SemanticBlock(widths[i], widths[i + 1], s, cfg) for i, s in enumerate(cfg["strides"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class _SnakeUnit(nn.Module):
    def __init__(self, c: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(c)
        self.conv1 = nn.Conv1d(c, c, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(c)
        self.conv2 = nn.Conv1d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))  # lengths kept: no crop


class _AcousticBlock(nn.Module):
    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (_SnakeUnit(c, d) for d in (1, 3, 9))
        self.snake1 = Snake(c)
        self.conv1 = nn.Conv1d(c, 2 * c, 2 * stride, stride, padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class AcousticEncoder(nn.Module):
    """The DAC encoder: audio [B, 1, S] → [B, D, T]."""

    def __init__(self, acoustic: dict[str, Any]) -> None:
        super().__init__()
        c, ratios = acoustic["encoder_hidden_size"], list(acoustic["downsampling_ratios"])
        self.conv1 = nn.Conv1d(1, c, 7, padding=3)
        self.block = nn.ModuleList(_AcousticBlock(c * 2**i, s) for i, s in enumerate(ratios))
        self.snake1 = Snake(c * 2 ** len(ratios))
        self.conv2 = nn.Conv1d(c * 2 ** len(ratios), acoustic["hidden_size"], 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))

    def frames(self, samples: int) -> int:
        """Output frames for `samples` inputs (every convolution's length rule, in order)."""
        n = samples
        for m in self.modules():
            if isinstance(m, nn.Conv1d):
                k, s, p, d = m.kernel_size[0], m.stride[0], m.padding[0], m.dilation[0]
                n = (n + 2 * p - d * (k - 1) - 1) // s + 1
        return n


class _Quantizer(nn.Module):
    def __init__(self, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.codebook = _Codebook(size, dim)
        self.project_in = nn.Linear(width, dim)
        self.project_out = nn.Linear(dim, width)


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(size, dim))


class _ResidualQuantizer(nn.Module):
    def __init__(self, n: int, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(_Quantizer(size, dim, width) for _ in range(n))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, W] → codes [T, n]: each codebook's nearest code to what is left."""
        codes = []
        for q in self.quantizers:
            z = q.project_in(x)
            e = q.codebook.embed.t()
            score = -(z.pow(2).sum(1, keepdim=True) - 2 * z @ e + e.pow(2).sum(0, keepdim=True))
            idx = score.max(dim=-1).indices
            x = x - q.project_out(F.embedding(idx, q.codebook.embed))
            codes.append(idx)
        return torch.stack(codes, dim=1)


# --- the tokenizer's encode path -----------------------------------------------------------------
class HiggsEncoder(nn.Module):
    """The encoder of bosonai/higgs-audio-v2-tokenizer; `cfg` is the tokenizer config (transformers'
    layout). Its parameter names are the checkpoint's."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        acoustic, semantic = cfg["acoustic_model_config"], cfg["semantic_model_config"]
        width = acoustic["hidden_size"] + semantic["hidden_size"]
        self.sample_rate, self.semantic_rate = cfg["sample_rate"], cfg["semantic_sample_rate"]
        hop = math.prod(acoustic["downsampling_ratios"])
        self.semantic_step = int(hop / (self.sample_rate / self.semantic_rate) / cfg["downsample_factor"])
        self.pad = hop // 2
        self.acoustic_encoder = AcousticEncoder(acoustic)
        self.semantic_model = Hubert(semantic)
        self.encoder_semantic = SemanticEncoder(cfg)
        self.fc = nn.Linear(width, width)
        self.quantizer = _ResidualQuantizer(h.N_CODEBOOKS, cfg["codebook_size"], cfg["codebook_dim"], width)

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """One clip [S] float at `sample_rate` → codes [T, 8] int64 at 25 Hz (T = ceil(S / 960) for
        the published configs)."""
        x = audio.to(self.fc.weight.dtype)[None]
        low = F.pad(resample(x, self.sample_rate, self.semantic_rate), (SEMANTIC_PAD, SEMANTIC_PAD))
        semantic = self.semantic_model(low)[:, :: max(1, self.semantic_step)]
        semantic = self.encoder_semantic(semantic.transpose(1, 2))  # [1, D, T]
        if self.acoustic_encoder.frames(x.shape[-1]) != semantic.shape[-1]:
            x = F.pad(x, (self.pad, self.pad))
        acoustic = self.acoustic_encoder(x[:, None])  # [1, D, T]
        both = self.fc(torch.cat([acoustic, semantic], dim=1)[0].t())  # [T, W]
        return self.quantizer.encode(both)

    @classmethod
    def from_config(cls, path: str, dtype: torch.dtype, device, seed: int = 1) -> HiggsEncoder:
        """Random weights for a shipped config (normal, scaled by fan-in; random codebooks)."""
        with open(path) as f:
            model = cls(json.load(f))
        random_init(model, seed)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device) -> HiggsEncoder:
        """The tokenizer checkpoint in transformers' layout (weight-normed convolutions folded)."""
        parts = ("acoustic_encoder", "semantic_model", "encoder_semantic", "fc", "quantizer")
        return load_parts(cls, id_or_dir, dtype, device, parts)


@torch.no_grad()
def random_init(model: HiggsEncoder, seed: int) -> None:
    """Random weights drawn on the CPU in float32 in parameter order: normal scaled by fan-in,
    random codebooks (a zero codebook would make every code alike), small random biases, Snake
    alphas around 1, norms around 1; the acoustic and semantic features of a similar scale, so that
    each moves the codes."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif leaf == "alpha" or (leaf == "weight" and p.dim() == 1):
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf == "bias":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        else:
            # the DAC encoder grows the signal ~30x: its last conv brings it to the semantic part's scale
            gain = 0.03 if name == "acoustic_encoder.conv2.weight" else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * gain * p[0].numel() ** -0.5)
