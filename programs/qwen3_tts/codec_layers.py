"""The layers of Qwen3-TTS-Tokenizer-12Hz's decoder (programs/qwen3_tts/codec.py), under the reference's
names: each stateful layer (`state_shape`) reads its past from, and writes its next past into, the
state buffers of the decode's `Contexts` in place, so one code path decodes a whole utterance (from
a zero state of one row) and a stream's window (slots of the streams' state).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Contexts:
    """One decode's state, read and written in place by each stateful layer (by its `state_index`):
    states (one per stateful layer: a conv's [rows, *state_shape], an attention's ring
    [n_slots, 2, kv_heads, ring, head_dim]), slots [B] (the rows entries write) and read [B] (the
    rows their conv states come from: a fresh entry reads a row kept at zero)."""

    def __init__(self, states: list[torch.Tensor], slots: torch.Tensor, read: torch.Tensor) -> None:
        self.states, self.slots, self.read = states, slots, read

    def extend(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] after the layer's past [B, C, context] (one gather); its last `context`
        samples go back to the slots as their next past (one scatter)."""
        if not layer.context:
            return x
        history = self.states[layer.state_index]
        x = torch.cat([history.index_select(0, self.read), x], dim=-1)
        history.index_copy_(0, self.slots, x[..., -layer.context :])
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
    """Causal attention over the last `window` frames. Its state: a ring per slot of the rotated
    keys and values of its last `ring` frames, frame p at ring position p % ring,
    [n_slots, 2, kv_heads, ring, head_dim]; `state_shape` is what a slot needs at the least."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or dim // self.heads
        self.q_proj = nn.Linear(dim, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, dim, bias=bias)
        self.window = cfg["sliding_window"]
        self.state_shape = (2, self.kv_heads, self.window - 1, self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple, ctx: Contexts) -> torch.Tensor:
        """x [B, R, dim]; rope = (cos, sin [B, 1, R, head_dim], at [B, 1, 1, R] int64: the
        ring positions of the R frames, mask [B, 1, R, ring] bool over the ring once they are in).
        Writes the R new keys and values into the slots' rings, then attends over each ring."""
        b, r, _ = x.shape
        cos, sin, at, mask = rope
        q = self.q_proj(x).view(b, r, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        ring = ctx.states[self.state_index]
        part = torch.arange(2, device=x.device)[:, None, None]
        heads = torch.arange(self.kv_heads, device=x.device)[:, None]
        ring.index_put_((ctx.slots[:, None, None, None], part, heads, at), torch.stack([k, v], dim=1))
        past = ring.index_select(0, ctx.slots)  # [B, 2, kv_heads, ring, head_dim]
        out = F.scaled_dot_product_attention(
            q, past[:, 0], past[:, 1], attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
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

    def forward(self, x: torch.Tensor, rope: tuple, ctx: Contexts) -> torch.Tensor:
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """latent → hidden, sliding-window layers (RoPE by stream position), norm, → latent:
    x [B, R, latent], start [B] int64 (the stream position of x's first frame) → [B, R, latent].
    A ring of `ring` frames holds the window's `window - 1` frames before a frame and up to
    `ring - window + 1` frames of one pass; longer windows run their layers in passes of that many."""

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
        h = self.input_proj(x)
        ring = ctx.states[self.layers[0].self_attn.state_index].shape[3]
        step = ring - (self.window - 1)  # frames per pass
        # a window within one pass takes its frames whole (no slicing by the pass: a compile with
        # the window's length dynamic then guards only that it fits)
        parts = (
            [(0, h)] if h.shape[1] <= step else [(f, h[:, f : f + step]) for f in range(0, h.shape[1], step)]
        )
        out = []
        for first, part in parts:
            rope = self._rope(start + first, part.shape[1], ring, part.dtype)
            for layer in self.layers:
                part = layer(part, rope, ctx)
            out.append(part)
        return self.output_proj(self.norm(out[0] if len(out) == 1 else torch.cat(out, dim=1)))

    def _rope(self, start: torch.Tensor, r: int, ring: int, dtype: torch.dtype) -> tuple:
        """start [B] int64, r frames → (cos, sin, ring positions, mask) of Attention.forward."""
        dev, d = start.device, self.head_dim
        pos = start[:, None] + torch.arange(r, device=dev)  # [B, R]
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        freqs = pos.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, R, D]
        end = (start + r)[:, None]
        # ring entry j holds frame end - ring + ((j - end) mod ring): the latest p < end with p ≡ j;
        # p < 0 is no frame of this stream (zeros or another stream's), as the window's bound masks
        keys = end - ring + torch.remainder(torch.arange(ring, device=dev) - end, ring)  # [B, ring]
        gap = pos[:, :, None] - keys[:, None, :]  # [B, R, ring]
        mask = ((keys[:, None, :] >= 0) & (gap >= 0) & (gap < self.window))[:, None]
        at = torch.remainder(pos, ring)[:, None, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype), at, mask


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
