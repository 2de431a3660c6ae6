"""Kyutai Mimi's encoder: 24 kHz audio → codes of a split residual vector quantizer, batched.

Based on Mimi (Défossez et al. 2024) as transformers' `MimiModel.encode` runs it, under its
parameter names: the SEANet convolution encoder (a causal conv, then per ratio of
`upsampling_ratios` reversed, residual blocks of ELU + causal convs and an ELU + strided conv of
kernel 2·ratio; a last ELU + conv to `hidden_size`), the encoder transformer (pre-LayerNorm, RoPE,
causal attention over a sliding window, GELU MLP, layer scales), the downsampling conv (kernel
2·stride, replicate padding) to the frame rate, and the split RVQ's encode: the semantic
quantizer's first codebook and the acoustic quantizer's codebooks, each choosing the code nearest
its input's residual (a code's vector is `embed_sum / cluster_usage`).

Batching: clips of different lengths ride in one padded batch and each gets the codes it gets
alone. Every conv is causal, so an output sees only its own and earlier inputs but for the last
one, whose window reaches into the padding: before each conv the positions past a clip's length
are set to what that conv pads a lone clip with (zeros; the last valid value for the replicate
padding), and the transformer's causal mask keeps valid frames from reading later ones. A clip of
S samples has ceil(S / hop) frames (hop = prod(upsampling_ratios) · downsampling stride).

Users: Qwen3-TTS Base's reference codes (its 12 Hz tokenizer's encoder is a MimiModel whose
first `encoder_valid_num_quantizers` = 16 codebooks it keeps) and CSM's audio context (32).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors, random_weights


class CausalConv(nn.Module):
    """A causal Conv1d with Mimi's padding: `kernel - stride` (dilated kernel) on the left, then on
    the right up to a whole last output; the padding is zeros or (replicate) the edge value."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, *, bias: bool = True
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.pad = (kernel - 1) * dilation + 1 - stride
        self.replicate = False

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, L] with lengths [B] valid positions → ([B, C', ceil(L / stride)], ceil(lengths / stride))."""
        pos = torch.arange(x.shape[-1], device=x.device)
        if self.replicate:  # the lone clip's right padding repeats its last valid value
            idx = torch.minimum(pos[None, :], lengths[:, None] - 1)
            x = torch.gather(x, 2, idx[:, None, :].expand(x.shape[0], x.shape[1], -1))
        else:
            x = x * (pos[None, :] < lengths[:, None])[:, None, :].to(x.dtype)
        right = -(-x.shape[-1] // self.stride) * self.stride - x.shape[-1]  # to a whole last output
        x = F.pad(x, (self.pad, right), mode="replicate" if self.replicate else "constant")
        return self.conv(x), torch.div(lengths + self.stride - 1, self.stride, rounding_mode="floor")


class ResnetBlock(nn.Module):
    """SEANet's residual block: x + conv1(ELU(conv0(ELU(x)))) (`block.1`, `block.3`)."""

    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                CausalConv(dim, hidden, kernel, dilation=dilation),
                nn.ELU(),
                CausalConv(hidden, dim, 1),
            ]
        )

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.block[1](F.elu(x), lengths)
        h, _ = self.block[3](F.elu(h), lengths)
        return x + h, lengths


class Seanet(nn.Module):
    """The SEANet encoder, its `layers` indexed as transformers' `encoder_seanet.layers`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        nf, compress = cfg["num_filters"], cfg["compress"]
        layers: list[nn.Module] = [CausalConv(cfg["audio_channels"], nf, cfg["kernel_size"])]
        scale = 1
        for ratio in reversed(cfg["upsampling_ratios"]):
            dim = scale * nf
            for j in range(cfg["num_residual_layers"]):
                dilation = cfg["dilation_growth_rate"] ** j
                layers.append(ResnetBlock(dim, dim // compress, cfg["residual_kernel_size"], dilation))
            layers += [nn.ELU(), CausalConv(dim, dim * 2, 2 * ratio, stride=ratio)]
            scale *= 2
        layers += [nn.ELU(), CausalConv(scale * nf, cfg["hidden_size"], cfg["last_kernel_size"])]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            if isinstance(layer, nn.ELU):
                x = F.elu(x)
            else:
                x, lengths = layer(x, lengths)
        return x, lengths


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T, H], cos/sin [T, D], mask [T, T] bool (True: may attend) → [B, T, H]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the two halves of the head dim (rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, bias=False)
        self.fc2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        self.self_attn = SelfAttention(
            h, heads, cfg.get("num_key_value_heads") or heads, head_dim, cfg.get("attention_bias", False)
        )
        self.mlp = Mlp(h, cfg["intermediate_size"])
        self.input_layernorm = nn.LayerNorm(h, eps=cfg["norm_eps"])
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg["norm_eps"])
        self.self_attn_layer_scale = LayerScale(h)
        self.mlp_layer_scale = LayerScale(h)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The encoder transformer: causal attention over the last `sliding_window` frames."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"Mimi's encoder transformer runs GELU, not {cfg['hidden_act']!r}")
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.window = cfg["sliding_window"]
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, self.head_dim) for _ in range(cfg["num_hidden_layers"])
        )
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Mimi's encoder has plain RoPE, not {rope['rope_type']!r}")
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] → [B, T, H]."""
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        back = pos[:, None] - pos[None, :]  # query i may see key j when 0 <= i - j < window
        mask = (back >= 0) & (back < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class ResidualQuantizer(nn.Module):
    """One residual vector quantizer's encode: an optional 1×1 input projection, then each
    codebook picks the code nearest the residual left by the ones before it."""

    def __init__(self, hidden: int, dim: int, n_q: int, size: int, project: bool) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(hidden, dim, 1, bias=False) if project else None
        self.register_buffer("codebooks", torch.zeros(n_q, size, dim, dtype=torch.float32))  # [n_q, K, D]

    def forward(self, latent: torch.Tensor, n_q: int) -> torch.Tensor:
        """latent [B, H, T] → codes [B, T, n_q] int64."""
        x = latent if self.input_proj is None else self.input_proj(latent)
        residual = x.transpose(1, 2).float()  # [B, T, D]
        codes = []
        for book in self.codebooks[:n_q]:
            dist = torch.cdist(residual, book[None].expand(residual.shape[0], -1, -1))  # [B, T, K]
            idx = dist.argmin(dim=-1)
            residual = residual - book[idx]  # codebooks stay float32 (`_float_codebooks`)
            codes.append(idx)
        return torch.stack(codes, dim=-1)


class SplitQuantizer(nn.Module):
    """Mimi's split RVQ: `num_semantic_quantizers` semantic codebooks, then the acoustic ones,
    both quantizing the same latent."""

    def __init__(self, cfg: dict[str, Any], n_q: int | None = None) -> None:
        super().__init__()
        hidden, dim = cfg["hidden_size"], cfg.get("codebook_dim") or cfg["hidden_size"]
        project = cfg.get("vector_quantization_hidden_dimension", hidden) != hidden
        self.n_semantic = cfg["num_semantic_quantizers"]
        size = cfg["codebook_size"]
        self.semantic_residual_vector_quantizer = ResidualQuantizer(
            hidden, dim, self.n_semantic, size, project
        )
        n_acoustic = (n_q or cfg["num_quantizers"]) - self.n_semantic  # the codebooks kept
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(hidden, dim, n_acoustic, size, project)

    def forward(self, latent: torch.Tensor, n_q: int) -> torch.Tensor:
        """latent [B, H, T] → codes [B, T, n_q] int64."""
        codes = self.semantic_residual_vector_quantizer(latent, min(n_q, self.n_semantic))
        if n_q > self.n_semantic:
            rest = self.acoustic_residual_vector_quantizer(latent, n_q - self.n_semantic)
            codes = torch.cat([codes, rest], dim=-1)
        return codes


class MimiEncoder(nn.Module):
    """Mimi's encoder from a transformers `MimiConfig`-shaped dict `cfg`, keeping the first `n_q`
    codebooks (all by default)."""

    def __init__(self, cfg: dict[str, Any], n_q: int | None = None) -> None:
        super().__init__()
        if not cfg.get("use_causal_conv", True) or cfg.get("pad_mode", "constant") != "constant":
            raise ValueError("MimiEncoder runs causal convs with constant padding (Mimi's)")
        if cfg.get("use_conv_shortcut", False):
            raise ValueError("MimiEncoder's residual blocks have no conv shortcut (Mimi's)")
        self.n_q = n_q or cfg["num_quantizers"]
        if not cfg["num_semantic_quantizers"] <= self.n_q <= cfg["num_quantizers"]:
            raise ValueError(f"n_q {self.n_q} is not in [semantic, num_quantizers]")
        self.sample_rate = cfg.get("sampling_rate", 24000)
        seanet_hop = math.prod(cfg["upsampling_ratios"])
        frame_rate = cfg.get("frame_rate") or cfg.get("_frame_rate") or self.sample_rate / (seanet_hop * 2)
        stride = int(math.ceil(self.sample_rate / seanet_hop) / frame_rate)
        self.hop = seanet_hop * stride  # samples per frame
        self.encoder_seanet = Seanet(cfg)
        self.encoder_transformer = Transformer(cfg)
        self.downsample = None
        if stride != 1:
            h = cfg["hidden_size"]
            self.downsample = CausalConv(h, h, 2 * stride, stride=stride, bias=False)
            self.downsample.replicate = True
        self.quantizer = SplitQuantizer(cfg, self.n_q)

    @torch.no_grad()
    def latents(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio [B, S] float32 (each clip's first lengths[b] samples) → the pre-quantization
        latent [B, H, T] and each clip's frames [B] int64. Every length must be at least 1."""
        x = audio[:, None, :].to(self.encoder_transformer.inv_freq.device, self._dtype)
        lengths = lengths.to(x.device)
        x, n = self.encoder_seanet(x, lengths)
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            x, n = self.downsample(x, n)
        return x, n

    @torch.no_grad()
    def encode(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio [B, S] float32 padded clips, lengths [B] int64 samples → codes [B, T, n_q] int64
        (0 past a clip's frames) and frames [B] int64 (ceil(lengths / hop))."""
        if len(lengths) and int(lengths.min()) < 1:
            raise ValueError("MimiEncoder encodes clips of at least one sample")
        latent, frames = self.latents(audio, lengths)
        codes = self.quantizer(latent, self.n_q)
        valid = torch.arange(codes.shape[1], device=codes.device)[None, :] < frames[:, None]
        return codes * valid[:, :, None], frames

    @property
    def _dtype(self) -> torch.dtype:
        return self.encoder_transformer.layers[0].mlp.fc1.weight.dtype

    # --- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers' Mimi names (`encoder.encoder_seanet.*`, `encoder.encoder_transformer.*`,
        `encoder.downsample.*`, `quantizer.*`; or the older flat `encoder.layers.*`,
        `encoder_transformer.*`, `downsample.*`) → this module; a codebook's vectors are
        `embed_sum / cluster_usage.clamp(1e-5)`. The decoder's weights are passed over."""
        books: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        params: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = _mapped(name)
            if name is None:
                continue
            if ".codebook." in name:  # quantizer.<rvq>.layers.<j>.codebook.<field>
                rvq, rest = name.removeprefix("quantizer.").split(".layers.")
                j, _, field = rest.split(".", 2)
                books.setdefault((rvq, int(j)), {})[field] = tensor
            else:
                params.append((name, tensor))
        loaded = copy_weights(self, params, skip=lambda n: False)
        for (rvq, j), fields in books.items():
            quantizer = getattr(self.quantizer, rvq)
            if j < len(quantizer.codebooks):
                usage = fields["cluster_usage"].float().clamp(min=1e-5)
                quantizer.codebooks[j].copy_(fields["embed_sum"].float() / usage[:, None])
                loaded.add(f"quantizer.{rvq}.codebooks.{j}")
        return loaded

    @classmethod
    def from_config(
        cls,
        cfg: dict[str, Any],
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        n_q: int | None = None,
        seed: int = 0,
    ) -> MimiEncoder:
        """Random weights (`--load-format dummy`): normal convs and projections, random codebooks."""
        model = _float_codebooks(cls(cfg, n_q).to(device=device, dtype=dtype))
        random_weights(model, device, seed)
        gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 1)
        for q in (
            model.quantizer.semantic_residual_vector_quantizer,
            model.quantizer.acoustic_residual_vector_quantizer,
        ):
            q.codebooks.copy_(torch.randn(q.codebooks.shape, generator=gen, device=device) * 0.02)
        return model.eval()

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device: str | torch.device) -> MimiEncoder:
        """A transformers Mimi checkpoint (`kyutai/mimi`), or a Qwen3-TTS 12 Hz tokenizer's (its
        `encoder_config` and `encoder.*` weights, the first `encoder_valid_num_quantizers`
        codebooks); a folder or a hub id, or a Qwen3-TTS model whose `speech_tokenizer/` holds it."""
        path, config = checkpoint_dir(id_or_dir)
        if config.get("model_type") == "qwen3_tts":
            path, config = checkpoint_dir(os.path.join(path, "speech_tokenizer"))
        prefix, n_q = "", None
        if "encoder_config" in config and config.get("model_type") != "mimi":
            prefix, n_q = "encoder.", config.get("encoder_valid_num_quantizers")
            config = config["encoder_config"]
        model = _float_codebooks(cls(config, n_q).to(device=device, dtype=dtype))
        loaded = load_safetensors(
            path,
            device,
            lambda ws: model.load_weights((n.removeprefix(prefix), t) for n, t in ws),
            keep=lambda n: n.startswith(prefix),
        )
        missing = _expected(model) - loaded
        if missing:
            raise ValueError(
                f"{id_or_dir}: the checkpoint lacks {len(missing)} encoder weights, e.g. {sorted(missing)[:3]}"
            )
        return model.eval()


def _float_codebooks(model: MimiEncoder) -> MimiEncoder:
    """The codebooks back in float32 after a cast of the module: the nearest code is chosen in fp32."""
    for q in (
        model.quantizer.semantic_residual_vector_quantizer,
        model.quantizer.acoustic_residual_vector_quantizer,
    ):
        q.codebooks = q.codebooks.float()
    return model


def _mapped(name: str) -> str | None:
    """A transformers Mimi weight name → this module's, or None for what encoding never reads."""
    for old, new in (
        ("encoder.encoder_seanet.", "encoder_seanet."),
        ("encoder.encoder_transformer.", "encoder_transformer."),
        ("encoder.downsample.", "downsample."),
        ("encoder.layers.", "encoder_seanet.layers."),
    ):
        if name.startswith(old):
            return new + name.removeprefix(old)
    if name.startswith(("encoder_transformer.", "downsample.")):
        return name
    if name.startswith("quantizer.") and ".output_proj." not in name and not name.endswith(".initialized"):
        return name
    return None


def _expected(model: MimiEncoder) -> set[str]:
    names = {n for n, _ in model.named_parameters()}
    for q in ("semantic_residual_vector_quantizer", "acoustic_residual_vector_quantizer"):
        names |= {f"quantizer.{q}.codebooks.{j}" for j in range(len(getattr(model.quantizer, q).codebooks))}
    return names
