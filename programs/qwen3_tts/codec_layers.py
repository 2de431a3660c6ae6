"""The layers of Qwen3-TTS-Tokenizer-12Hz's decoder (programs/qwen3_tts/codec.py), under the reference's
names: each stateful layer (`state_shape`) reads its past from, and leaves its next past in, the
decode's `Contexts`, so one code path decodes a whole utterance (zero past) and a stream's window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Contexts:
    """One decode's state: each stateful layer reads its past (`get`, [B, *state_shape]) and leaves
    what the next window needs (`put`), by its `state_index`."""

    def __init__(self, past: list[torch.Tensor]) -> None:
        self.past = past
        self.new: list[torch.Tensor | None] = [None] * len(past)

    def get(self, layer: nn.Module) -> torch.Tensor:
        return self.past[layer.state_index]

    def put(self, layer: nn.Module, state: torch.Tensor) -> None:
        self.new[layer.state_index] = state

    def extend(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] after the layer's past [B, C, context], whose last `context` samples are its
        next past."""
        if not layer.context:
            return x
        x = torch.cat([self.get(layer), x], dim=-1)
        self.put(layer, x[..., -layer.context :])
        return x


class CausalConvNet(nn.Module):
    """Conv1d (stride 1) padded on the left only: [B, Cin, T] → [B, Cout, T]; its past is the last
    (kernel - 1) · dilation input samples, zeros at a stream's start."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        self.state_shape = (cin, self.context) if self.context else None

    def forward(self, x: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        return self.conv(ctx.extend(self, x))


class CausalTransConvNet(nn.Module):
    """ConvTranspose1d (kernel a multiple of the stride s) trimmed to s outputs per input:
    [B, Cin, T] → [B, Cout, T · s]. Outputs of input t also take the tails of the `context` inputs
    before it, its past. Computed as one matmul and an overlap-add of its k / s blocks of s samples
    (the same sums as the convolution's; CPUs run small transposed convolutions slowly)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        assert kernel % stride == 0, "a transposed convolution's kernel is a multiple of its stride"
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.context = kernel // stride - 1
        self.state_shape = (cin, self.context) if self.context else None

    def forward(self, x: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        b, t, c, s = x.shape[0], x.shape[-1], self.context, self.stride
        w = self.conv.weight  # [Cin, Cout, k]
        z = ctx.extend(self, x).transpose(1, 2) @ w.flatten(1)  # [B, c + T, Cout · k]
        z = z.view(b, c + t, w.shape[1], c + 1, s)  # input i's block j lands on output block i + j
        y = z[:, c:, :, 0]
        for j in range(1, c + 1):
            y = y + z[:, c - j : c - j + t, :, j]
        return y.permute(0, 2, 1, 3).reshape(b, w.shape[1], t * s) + self.conv.bias[:, None]


class SnakeBeta(nn.Module):
    """x + sin²(x · e^alpha) / e^beta per channel: [B, C, T] → [B, C, T]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(x * self.alpha.exp()[:, None]).pow(2) / (self.beta.exp()[:, None] + 1e-9)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (7), LayerNorm, MLP ×4 (GELU), scaled residual: [B, C, T] → [B, C, T]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConvNet(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        h = self.norm(self.dwconv(x, ctx).transpose(1, 2))
        h = self.gamma * self.pwconv2(self.act(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta, causal conv (7, dilated), SnakeBeta, conv (1), residual: [B, C, T] → [B, C, T]."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConvNet(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConvNet(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        h = self.conv1(self.act1(x), ctx)
        return x + self.conv2(self.act2(h), ctx)


class DecoderBlock(nn.Module):
    """SnakeBeta, ×rate transposed conv (kernel 2·rate) halving the channels, three residual units:
    [B, C, T] → [B, C/2, T · rate]."""

    def __init__(self, cin: int, rate: int) -> None:
        super().__init__()
        cout = cin // 2
        units = [ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConvNet(cin, cout, 2 * rate, rate), *units])

    def forward(self, x: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        x = self.block[1](self.block[0](x), ctx)
        for unit in self.block[2:]:
            x = unit(x, ctx)
        return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Named(nn.Module):
    """A container that only gives its children (modules, parameters) their checkpoint names."""

    def __init__(self, **children: nn.Module | nn.Parameter) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class Mlp(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves: x [B, H, R, D], cos/sin [B, 1, R, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Causal attention over the last `window` frames. Its past: the keys (rotated) and values of
    the `window - 1` frames before the window, [B, 2, kv_heads, window - 1, head_dim]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or dim // self.heads
        self.q_proj = nn.Linear(dim, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, dim, bias=bias)
        self.state_shape = (2, self.kv_heads, cfg["sliding_window"] - 1, self.head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, ctx: Contexts
    ):
        """x [B, R, dim], cos/sin [B, 1, R, head_dim], mask [B, 1, R, window - 1 + R] bool."""
        b, r, _ = x.shape
        q = self.q_proj(x).view(b, r, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        past = ctx.get(self)
        keys = torch.cat([past[:, 0], k], dim=2)
        values = torch.cat([past[:, 1], v], dim=2)
        ctx.put(self, torch.stack([keys[:, :, r:], values[:, :, r:]], dim=1))
        groups = self.heads // self.kv_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, r, -1))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, eps, scale = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["layer_scale_initial_scale"]
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(dim, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.self_attn_layer_scale = Named(scale=nn.Parameter(torch.full((dim,), scale)))
        self.mlp_layer_scale = Named(scale=nn.Parameter(torch.full((dim,), scale)))

    def forward(self, x: torch.Tensor, cos, sin, mask, ctx: Contexts) -> torch.Tensor:
        x = x + self.self_attn_layer_scale.scale * self.self_attn(
            self.input_layernorm(x), cos, sin, mask, ctx
        )
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """latent → hidden, sliding-window layers (RoPE by stream position), norm, → latent:
    x [B, R, latent], start [B] int64 (the stream position of x's first frame) → [B, R, latent]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.input_proj = nn.Linear(cfg["latent_dim"], cfg["hidden_size"])
        self.output_proj = nn.Linear(cfg["hidden_size"], cfg["latent_dim"])
        self.window = cfg["sliding_window"]
        self.rope_theta = float(cfg.get("rope_theta", 10000.0))
        self.head_dim = self.layers[0].self_attn.head_dim

    def forward(self, x: torch.Tensor, start: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        r, dev = x.shape[1], x.device
        pos = start[:, None] + torch.arange(r, device=dev)  # [B, R]
        d = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        freqs = pos.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, R, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        keys = start[:, None] - (self.window - 1) + torch.arange(self.window - 1 + r, device=dev)  # [B, K]
        gap = pos[:, :, None] - keys[:, None, :]  # [B, R, K]
        mask = ((keys[:, None, :] >= 0) & (gap >= 0) & (gap < self.window))[:, None]
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, ctx)
        return self.output_proj(self.norm(h))


class ResidualVectorQuantizer(nn.Module):
    """n codebooks of `dim`, summed, projected to `outer` (input_proj serves the encoder only)."""

    def __init__(self, n: int, dim: int, outer: int, size: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(outer, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, outer, 1, bias=False)
        books = (
            Named(
                cluster_usage=nn.Parameter(torch.ones(size)),
                embedding_sum=nn.Parameter(torch.zeros(size, dim)),
            )
            for _ in range(n)
        )
        self.vq = Named(layers=nn.ModuleList(Named(_codebook=book) for book in books))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, n] → [B, T, outer]: the sum of each code's `embedding_sum / cluster_usage`."""
        total = 0
        for i, layer in enumerate(self.vq.layers):
            book, code = layer._codebook, codes[..., i]
            total = (
                total + F.embedding(code, book.embedding_sum) / book.cluster_usage.clamp(min=1e-5)[code, None]
            )
        return F.linear(total, self.output_proj.weight[:, :, 0])


class SplitResidualVectorQuantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic), each group with its own projection."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        outer, n, size = cfg["codebook_dim"], cfg["num_quantizers"], cfg["codebook_size"]
        self.rvq_first = ResidualVectorQuantizer(1, outer // 2, outer, size)
        self.rvq_rest = ResidualVectorQuantizer(n - 1, outer // 2, outer, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, num_quantizers] → [B, T, codebook_dim]."""
        return self.rvq_first.decode(codes[..., :1]) + self.rvq_rest.decode(codes[..., 1:])
