"""Exact cropped decode of the SNAC decoder: compute only the activations that reach kept samples.

Based on the `snac` package's `Decoder` (snac/layers.py: conv in, DecoderBlocks of Snake →
ConvTranspose1d → NoiseBlock → ResidualUnits with dilations 1, 3, 9, then Snake → conv out → tanh).
Every layer is either pointwise in time (Snake, 1x1 convs, the noise, tanh), a stride-1 conv with
"same" zero padding, or a transposed conv; so the samples an output interval depends on form an
interval at every stage, computed backwards from the kept samples (`plan`).

The forward pass then carries, per stage, only the full-decode positions [lo, hi) it needs and runs
every conv without padding on that slice. Where the needed input reaches past the signal's edge,
the slice is zero-padded by exactly what the full decode's own padding adds there, so the values
are the full decode's (up to float summation order), edges included. The keyed noise is drawn at
the positions it has in the full decode (`normal_at`: the counter-based stream at an offset).

All interval arithmetic is on Python ints fixed by the input length and the kept range, so a
cropped decode is capturable in a CUDA graph like the full one. The quantizer's `from_codes`
(embedding, 1x1 projection, `repeat_interleave` by the level's stride; no local attention in
the 24 kHz model) is pointwise in time and a few positions long, so it stays whole.

SNAC 24 kHz, 4-frame window (latent 16 → 8192 samples), kept [2048, 4096): a block's three
ResidualUnits (k7, dilations 1, 3, 9) widen the need by 3 + 9 + 27 = 39 per side, its
ConvTranspose (kernel 2s, stride s) by about one input, so the needed inputs of the transposed convs are latent [0, 15) of 16,
[24, 72) of 128, [240, 528) of 1024, [1002, 2070) of 4096, and of conv out [2045, 4099) of 8192.
Convolution work per window (multiply-accumulates, full → cropped): conv in 12.7 → 11.9 M,
block 1 270 → 223 M, block 2 542 → 191 M, block 3 548 → 152 M, block 4 279 → 72 M, out 3.7 →
0.9 M; total 1656 → 651 M (0.39x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks import rng

Interval = tuple[int, int]  # [lo, hi) in full-decode positions of one stage


def normal_at(keys: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """`rng.normal(keys, start + n)[..., start:]` without drawing the first `start` values."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=keys.device)
    k = keys.unsqueeze(-1)
    u1 = rng.uniform(k, 2 * idx)
    u2 = rng.uniform(k, 2 * idx + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)


def _clip(lo: int, hi: int, t: int) -> Interval:
    return max(lo, 0), min(hi, t)


class _Op:
    """One decoder layer: its output length, the input interval an output interval needs, and the
    computation of that output interval from a tensor holding (at least) the needed input."""

    stage = ""

    def t_out(self, t_in: int) -> int:
        return t_in

    def need(self, out: Interval, t_in: int) -> Interval:
        return out

    def run(self, x: torch.Tensor, lo: int, t_in: int, out: Interval) -> torch.Tensor:
        raise NotImplementedError

    def macs(self, t_in: int, inp: Interval, out: Interval) -> int:
        """Multiply-accumulates of the convolutions per batch entry (0 for elementwise ops)."""
        return 0


@dataclass
class _Pointwise(_Op):
    module: nn.Module  # Snake1d, Tanh, or a 1x1 convolution

    def run(self, x, lo, t_in, out):
        return self.module(x[..., out[0] - lo : out[1] - lo])

    def macs(self, t_in, inp, out):
        m = self.module
        if isinstance(m, nn.Conv1d):
            return (out[1] - out[0]) * m.out_channels * m.in_channels // m.groups
        return 0


@dataclass
class _Conv(_Op):
    """Stride-1 conv with zero padding P: out[n] = sum_k w[k] · x[n - P + k·d], x = 0 outside."""

    module: nn.Conv1d
    taps: bool = False  # a depthwise conv as a sum of shifted slices (see CroppedDecoder)

    def __post_init__(self) -> None:
        m = self.module
        if m.stride[0] != 1 or not isinstance(m.padding[0], int):
            raise NotImplementedError("cropping needs stride-1 convs with numeric padding")
        self.pad, self.dil, self.k = m.padding[0], m.dilation[0], m.kernel_size[0]
        self.taps = self.taps and m.groups == m.in_channels == m.out_channels

    def t_out(self, t_in):
        return t_in + 2 * self.pad - self.dil * (self.k - 1)

    def _span(self, out: Interval) -> Interval:
        return out[0] - self.pad, out[1] - self.pad + self.dil * (self.k - 1)

    def need(self, out, t_in):
        return _clip(*self._span(out), t_in)

    def run(self, x, lo, t_in, out):
        want_lo, want_hi = self._span(out)
        have_lo, have_hi = _clip(want_lo, want_hi, t_in)
        x = x[..., have_lo - lo : have_hi - lo]
        if have_lo > want_lo or want_hi > have_hi:  # at the signal's edge: the full decode's zero padding
            x = F.pad(x, (have_lo - want_lo, want_hi - have_hi))
        m = self.module
        if not self.taps:
            return F.conv1d(x, m.weight, m.bias, 1, 0, m.dilation, m.groups)
        n = x.shape[-1] - self.dil * (self.k - 1)
        w = m.weight[:, 0, :, None]  # [C, k, 1]
        y = w[:, 0] * x[..., :n]
        for k in range(1, self.k):
            y = y + w[:, k] * x[..., k * self.dil : k * self.dil + n]
        return y if m.bias is None else y + m.bias[:, None]

    def macs(self, t_in, inp, out):
        m = self.module
        return (out[1] - out[0]) * m.out_channels * (m.in_channels // m.groups) * self.k


@dataclass
class _ConvTranspose(_Op):
    """out[n] = sum over i, k with i·s + k - p = n of w[k] · x[i], for inputs i in [0, T)."""

    module: nn.ConvTranspose1d

    def __post_init__(self) -> None:
        m = self.module
        if m.output_padding[0] != 0 or m.dilation[0] != 1:  # SNAC's odd strides (32/44 kHz)
            raise NotImplementedError("cropping needs transposed convs without output padding")
        self.s, self.p, self.k = m.stride[0], m.padding[0], m.kernel_size[0]

    def t_out(self, t_in):
        return (t_in - 1) * self.s - 2 * self.p + self.k

    def need(self, out, t_in):
        first = -((self.k - 1 - out[0] - self.p) // self.s)  # ceil((a + p - k + 1) / s)
        last = (out[1] - 1 + self.p) // self.s
        return _clip(first, last + 1, t_in)

    def run(self, x, lo, t_in, out):
        i0, i1 = self.need(out, t_in)
        m = self.module
        y = F.conv_transpose1d(x[..., i0 - lo : i1 - lo], m.weight, m.bias, self.s, 0, 0, m.groups)
        base = i0 * self.s - self.p  # full-decode position of y[..., 0]
        assert out[1] - base <= y.shape[-1]
        return y[..., out[0] - base : out[1] - base]

    def macs(self, t_in, inp, out):
        m = self.module
        return (inp[1] - inp[0]) * m.in_channels * (m.out_channels // m.groups) * self.k


@dataclass
class _Noise(_Op):
    """SNAC's NoiseBlock, x + noise · linear(x), with the caller's keyed noise at full positions."""

    module: nn.Module
    noise: Callable[[int, int, int], torch.Tensor]  # (block, start, n) → [B, n] float32
    block: int

    def run(self, x, lo, t_in, out):
        x = x[..., out[0] - lo : out[1] - lo]
        noise = self.noise(self.block, out[0], out[1] - out[0]).to(x.dtype)[:, None, :]
        return x + noise * self.module.linear(x)

    def macs(self, t_in, inp, out):
        lin = self.module.linear
        return (out[1] - out[0]) * lin.out_channels * lin.in_channels


class _Chain(_Op):
    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops

    def lengths(self, t_in: int) -> list[int]:
        ts = [t_in]
        for op in self.ops:
            ts.append(op.t_out(ts[-1]))
        return ts

    def t_out(self, t_in):
        return self.lengths(t_in)[-1]

    def plan(self, out: Interval, t_in: int) -> list[Interval]:
        """The interval each op's input needs, then the output interval: len(ops) + 1 entries."""
        ts = self.lengths(t_in)
        ivs = [out]
        for op, t in zip(reversed(self.ops), reversed(ts[:-1]), strict=True):
            ivs.append(op.need(ivs[-1], t))
        return ivs[::-1]

    def need(self, out, t_in):
        return self.plan(out, t_in)[0]

    def run(self, x, lo, t_in, out):
        ts, ivs = self.lengths(t_in), self.plan(out, t_in)
        for op, t, o in zip(self.ops, ts[:-1], ivs[1:], strict=True):
            x, lo = op.run(x, lo, t, o), o[0]
        return x

    def macs(self, t_in, inp, out):
        return sum(m for _, m in self.stage_macs(t_in, out))

    def stage_macs(self, t_in: int, out: Interval) -> list[tuple[str, int]]:
        ts, ivs = self.lengths(t_in), self.plan(out, t_in)
        return [
            (op.stage, op.macs(t, i, o))
            for op, t, i, o in zip(self.ops, ts[:-1], ivs[:-1], ivs[1:], strict=True)
        ]


class _Residual(_Chain):
    """SNAC's ResidualUnit: x + block(x); its "same" padding keeps lengths, so no inner crop of x."""

    def run(self, x, lo, t_in, out):
        return x[..., out[0] - lo : out[1] - lo] + super().run(x, lo, t_in, out)


def _flatten(
    module: nn.Module, noise: Callable[[int, int, int], torch.Tensor], blocks: dict[int, int], taps: bool
) -> list[_Op]:
    from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d

    if isinstance(module, nn.Sequential):
        return [op for child in module for op in _flatten(child, noise, blocks, taps)]
    if isinstance(module, ResidualUnit):
        return [_Residual(_flatten(module.block, noise, blocks, taps))]
    if isinstance(module, DecoderBlock):
        return _flatten(module.block, noise, blocks, taps)
    if isinstance(module, NoiseBlock):
        return [_Noise(module, noise, blocks[id(module)])]
    if isinstance(module, nn.ConvTranspose1d):
        return [_ConvTranspose(module)]
    if isinstance(module, nn.Conv1d):
        return [_Pointwise(module) if module.kernel_size[0] == 1 else _Conv(module, taps)]
    if isinstance(module, (Snake1d, nn.Tanh, nn.Identity)):
        return [_Pointwise(module)]
    raise NotImplementedError(f"no cropped decode for {type(module).__name__}")


class CroppedDecoder:
    """`decoder(z)[..., keep]` computed from the activations that reach `keep` only.

    `noise(block, start, n)` returns the keyed noise [B, n] of NoiseBlock number `block` (in
    `decoder.modules()` order) at full-decode positions [start, start + n).

    `taps=True` computes each depthwise convolution as the sum of its k shifted, weighted slices
    instead of a convolution kernel: slower eagerly (2k elementwise passes), but under
    `torch.compile` the taps fuse with the Snakes around them into one kernel, where the depthwise
    convolution kernels were the largest remaining cost (measured on the H200; SnacCodec.compiled)."""

    def __init__(
        self, decoder: nn.Module, noise: Callable[[int, int, int], torch.Tensor], taps: bool = False
    ) -> None:
        from snac.layers import DecoderBlock, NoiseBlock

        blocks = {id(m): i for i, m in enumerate(m for m in decoder.modules() if isinstance(m, NoiseBlock))}
        ops: list[_Op] = []
        block = 0  # stage names for FLOP reports: conv in, block 1..n, out
        for layer in decoder.model:
            if isinstance(layer, DecoderBlock):
                block += 1
            stage = f"block {block}" if isinstance(layer, DecoderBlock) else "out" if block else "conv in"
            for op in _flatten(layer, noise, blocks, taps):
                op.stage = stage
                ops.append(op)
        self.chain = _Chain(ops)

    def out_length(self, t_in: int) -> int:
        return self.chain.t_out(t_in)

    def input_interval(self, t_in: int, keep: Interval) -> Interval:
        """The latent positions that `keep` depends on."""
        return self.chain.need(keep, t_in)

    def __call__(self, z: torch.Tensor, keep: Interval, lo: int = 0, t_in: int | None = None) -> torch.Tensor:
        """z [B, C, hi - lo]: latent positions [lo, hi) of a latent of length t_in (default: z is
        the whole latent) holding at least `input_interval` → audio [B, 1, keep[1] - keep[0]]."""
        t_in = z.shape[-1] if t_in is None else t_in
        assert 0 <= keep[0] < keep[1] <= self.out_length(t_in), keep
        return self.chain.run(z, lo, t_in, keep)

    def macs_by_stage(self, t_in: int, keep: Interval) -> dict[str, int]:
        """Multiply-accumulates of the convolutions per stage, per batch entry."""
        out: dict[str, int] = {}
        for stage, m in self.chain.stage_macs(t_in, keep):
            out[stage] = out.get(stage, 0) + m
        return out
