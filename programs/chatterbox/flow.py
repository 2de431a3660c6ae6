"""S3Gen's token-to-mel half: S3 speech tokens [B, T] → 80-band mel frames [B, 80, 2T] at 50 Hz.

Based on chatterbox-tts 0.1.7's `CausalMaskedDiffWithXvec` (models/s3gen/flow.py, the reference), with
its parameter names (`s3gen.safetensors` under `flow.`) and arithmetic:

- the prompt's tokens then the request's are embedded, through a conformer encoder (a linear input
  layer, a 3-token look-ahead convolution, 6 blocks of relative-position self-attention, a nearest
  ×2 upsampling convolution, 4 more blocks) and projected to 80 channels: `mu`, two frames a token;
- conditional flow matching: noise [B, 80, 2(P + T)] integrated over 10 Euler steps of a cosine
  schedule through the estimator, a 1-D U-Net of causal convolutions and transformer blocks given
  (x, mu, the speaker's projected x-vector, the prompt's mel), with classifier-free guidance at rate
  0.7 (a pass without mu, speaker and prompt mel): d = 1.7 d_cond − 0.7 d_uncond;
- the frames after the prompt's 2P are the request's mel.

Every attention is over the whole (unpadded) sequence, so a frame's mel depends on every token of
the utterance; padded entries [B, Tmax] with lengths give their valid frames the unpadded result
(masked keys, masked inputs to the look-ahead and the convolutions).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CFG_RATE = 0.7  # CFM_PARAMS.inference_cfg_rate
STEPS = 10


def rel_positions(t: int, width: int, device: torch.device) -> torch.Tensor:
    """Sinusoids of the relative positions t-1 … -(t-1) [2t - 1, width] float32 (ESPnet's relative
    positional encoding: sin at even channels, cos at odd)."""
    r = torch.arange(t - 1, -t, -1, dtype=torch.float32, device=device)[:, None]
    div = torch.exp(
        torch.arange(0, width, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / width)
    )
    pe = torch.empty(2 * t - 1, width, device=device)
    pe[:, 0::2] = torch.sin(r * div)
    pe[:, 1::2] = torch.cos(r * div)
    return pe


class RelAttention(nn.Module):
    """Multi-head self-attention with ESPnet's relative positions (pos_bias_u / pos_bias_v)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.h, self.d = heads, width // heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d))

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        """x [B, T, W], keep [B, 1, 1, T] bool (valid keys), pe [2T - 1, W] → [B, T, W]."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d)
        k = self.linear_k(x).view(b, t, self.h, self.d).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d).transpose(1, 2)
        p = self.linear_pos(pe).view(-1, self.h, self.d).permute(1, 2, 0)  # [H, D, 2T - 1]
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, T, T]
        bd = (q + self.pos_bias_v).transpose(1, 2) @ p  # [B, H, T, 2T - 1]
        i = torch.arange(t, device=x.device)
        shift = (t - 1) - i[:, None] + i[None, :]  # column of relative position i - j
        bd = bd.gather(-1, shift.expand(b, self.h, t, t))
        scores = ((ac + bd) / math.sqrt(self.d)).masked_fill(~keep, -float("inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(~keep, 0.0)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(width, hidden)
        self.w_2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm self-attention then feed-forward (no convolution module, no macaron)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelAttention(width, heads)
        self.feed_forward = FeedForward(width, hidden)
        self.norm_mha = nn.LayerNorm(width, eps=1e-12)
        self.norm_ff = nn.LayerNorm(width, eps=1e-12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), keep, pe)
        return x + self.feed_forward(self.norm_ff(x))


class LinearInput(nn.Module):
    """The encoder's input layer: Linear, LayerNorm (`out.0`, `out.1`), then × sqrt(width)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, eps=1e-5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * math.sqrt(x.shape[-1])


class Lookahead(nn.Module):
    """A residual convolution over the next 3 tokens, then a causal one over the last 3."""

    def __init__(self, width: int, ahead: int = 3) -> None:
        super().__init__()
        self.ahead = ahead
        self.conv1 = nn.Conv1d(width, width, ahead + 1)
        self.conv2 = nn.Conv1d(width, width, 3)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [B, T, W] (zero where not valid), valid [B, T] bool → [B, T, W]."""
        y = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.ahead)))) * valid[:, None]
        return self.conv2(F.pad(y, (2, 0))).transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest ×2 along time, then a causal convolution of 5."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(x.transpose(1, 2), scale_factor=2.0, mode="nearest")
        return self.conv(F.pad(y, (4, 0))).transpose(1, 2)


class Encoder(nn.Module):
    """UpsampleConformerEncoder: token embeddings [B, T, W] → [B, 2T, W]."""

    def __init__(self, width: int, heads: int, hidden: int, blocks: int, up_blocks: int) -> None:
        super().__init__()
        self.embed = LinearInput(width)
        self.pre_lookahead_layer = Lookahead(width)
        self.encoders = nn.ModuleList(ConformerLayer(width, heads, hidden) for _ in range(blocks))
        self.up_layer = Upsample(width)
        self.up_embed = LinearInput(width)
        self.up_encoders = nn.ModuleList(ConformerLayer(width, heads, hidden) for _ in range(up_blocks))
        self.after_norm = nn.LayerNorm(width, eps=1e-5)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [B, T, W], valid [B, T] bool → [B, 2T, W] (valid frames: valid repeated twice)."""
        t, w = x.shape[1], x.shape[2]
        # Padded tokens enter the look-ahead as the zeros an unpadded sequence ends with.
        x = self.pre_lookahead_layer(self.embed(x) * valid[..., None], valid)
        keep, pe = valid[:, None, None, :], rel_positions(t, w, x.device).to(x.dtype)
        for layer in self.encoders:
            x = layer(x, keep, pe)
        # Masked again: the upsampling convolution looks back into the padding.
        x = self.up_embed(self.up_layer(x * valid[..., None]))
        valid2 = valid.repeat_interleave(2, dim=1)
        keep, pe = valid2[:, None, None, :], rel_positions(2 * t, w, x.device).to(x.dtype)
        for layer in self.up_encoders:
            x = layer(x, keep, pe)
        return self.after_norm(x)


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow times t [B] → [B, dim] (sin half, cos half, scale 1000)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = 1000 * t[:, None] * freqs[None, :]
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


class CausalConv(nn.Conv1d):
    """A convolution that sees the current and the kernel − 1 previous frames."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalBlock(nn.Module):
    """Causal convolution, LayerNorm over channels, Mish, on masked frames (`block.0`, `block.2`)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.block[0](x * mask)
        y = self.block[2](y.transpose(1, 2)).transpose(1, 2)
        return F.mish(y) * mask


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.ModuleList([nn.Identity(), nn.Linear(time_dim, dim_out)])
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp[1](F.mish(temb))[..., None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class Attention(nn.Module):
    """diffusers' self-attention: bias-free q/k/v, an output projection with bias (`to_out.0`)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, inner = heads, heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, T, C], bias [B, 1, 1, T] (0 or -1e10 per key) → [B, T, C]."""
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.h, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](y.transpose(1, 2).reshape(b, t, -1))


class GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerBlock(nn.Module):
    """diffusers' BasicTransformerBlock as the estimator uses it: self-attention, GELU feed-forward."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        y = self.norm3(x)
        for layer in self.ff.net:
            y = layer(y)
        return x + y


class TimeMLP(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, out)
        self.linear_2 = nn.Linear(out, out)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


def _stage(dim_in: int, dim: int, time_dim: int, blocks: int, heads: int, head_dim: int, conv: bool):
    stage = [ResnetBlock(dim_in, dim, time_dim)]
    stage.append(nn.ModuleList(TransformerBlock(dim, heads, head_dim) for _ in range(blocks)))
    if conv:
        stage.append(CausalConv(dim, dim, 3))
    return nn.ModuleList(stage)


class Estimator(nn.Module):
    """The flow's vector field (ConditionalDecoder with one causal level): (x, mask, mu, t, spks,
    cond) → dx/dt [B, 80, F]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        ch, mels = cfg["channels"], cfg["mels"]
        self.in_dim, time_dim = 4 * mels, 4 * ch
        self.time_mlp = TimeMLP(self.in_dim, time_dim)
        blk = (time_dim, cfg["n_blocks"], cfg["heads"], cfg["head_dim"])
        self.down_blocks = nn.ModuleList([_stage(self.in_dim, ch, *blk, conv=True)])
        self.mid_blocks = nn.ModuleList(_stage(ch, ch, *blk, conv=False) for _ in range(cfg["mid_blocks"]))
        self.up_blocks = nn.ModuleList([_stage(2 * ch, ch, *blk, conv=True)])
        self.final_block = CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, mels, 1)

    @staticmethod
    def _run(stage: nn.ModuleList, x: torch.Tensor, mask, temb, bias) -> torch.Tensor:
        x = stage[0](x, mask, temb).transpose(1, 2)
        for block in stage[1]:
            x = block(x, bias)
        return x.transpose(1, 2)

    def forward(self, x, mask, mu, t, spks, cond) -> torch.Tensor:
        """x, mu, cond [B, 80, F], mask [B, 1, F] float, t [B], spks [B, 80] → [B, 80, F]."""
        temb = self.time_mlp(time_embedding(t, self.in_dim).to(t.dtype))
        x = torch.cat([x, mu, spks[..., None].expand(-1, -1, x.shape[-1]), cond], dim=1)
        bias = ((1.0 - mask) * -1.0e10)[:, None]  # [B, 1, 1, F]
        down, up = self.down_blocks[0], self.up_blocks[0]
        skip = self._run(down, x, mask, temb, bias)
        x = down[2](skip * mask)
        for stage in self.mid_blocks:
            x = self._run(stage, x, mask, temb, bias)
        x = up[2](self._run(up, torch.cat([x, skip], dim=1), mask, temb, bias) * mask)
        return self.final_proj(self.final_block(x, mask) * mask) * mask


class Flow(nn.Module):
    """Tokens → mel (`flow.` in s3gen.safetensors): encoder, projection, flow matching."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        enc = cfg["encoder"]
        w, mels = enc["width"], cfg["mels"]
        self.mels, self.steps = mels, cfg.get("steps", STEPS)
        self.input_embedding = nn.Embedding(cfg["vocab"], w)
        self.spk_embed_affine_layer = nn.Linear(cfg["xvector_dim"], mels)
        self.encoder = Encoder(w, enc["heads"], enc["hidden"], enc["blocks"], enc["up_blocks"])
        self.encoder_proj = nn.Linear(w, mels)
        self.decoder = nn.Module()
        self.decoder.estimator = Estimator({**cfg["estimator"], "mels": mels})

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        cond: torch.Tensor,
        xvector: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """tokens [B, T] (the prompt's then the request's, padding anywhere before them), valid
        [B, T] bool, cond [B, 80, 2T] (the prompt's mel on its frames, zeros elsewhere), xvector
        [B, 192], noise [B, 80, 2T] → the mel of every frame [B, 80, 2T] (padded frames zero)."""
        spks = self.spk_embed_affine_layer(F.normalize(xvector, dim=1))
        x = self.input_embedding(tokens) * valid[..., None]
        mu = self.encoder_proj(self.encoder(x, valid)).transpose(1, 2)  # [B, 80, 2T]
        mask = valid.repeat_interleave(2, dim=1)[:, None].to(mu.dtype)
        return self.solve(noise, mask, mu, spks, cond)

    def solve(self, x, mask, mu, spks, cond) -> torch.Tensor:
        """Euler steps of the cosine schedule with classifier-free guidance (the unconditional half
        of the batch without mu, speaker and prompt mel)."""
        est, b = self.decoder.estimator, x.shape[0]
        span = 1 - torch.cos(torch.linspace(0, 1, self.steps + 1, device=x.device) * 0.5 * torch.pi)
        span = span.to(x.dtype)  # the reference casts the schedule to the estimator's precision
        zero = torch.zeros_like
        mu2, spks2, cond2 = (
            torch.cat([mu, zero(mu)]),
            torch.cat([spks, zero(spks)]),
            torch.cat([cond, zero(cond)]),
        )
        mask2 = torch.cat([mask, mask])
        for i in range(self.steps):
            t, r = span[i], span[i + 1]
            d = est(torch.cat([x, x]), mask2, mu2, t.expand(2 * b), spks2, cond2)
            x = x + (r - t) * ((1.0 + CFG_RATE) * d[:b] - CFG_RATE * d[b:])
        return x
