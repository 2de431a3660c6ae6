"""Counter-based random numbers: a pure function of (key, counter), computed with int64 tensor ops.

The sampler and the codec's noise draw from here instead of a global generator, so a request's
tokens and audio depend only on its seed, never on the batch it lands in, and the same code runs
eagerly, on CPU, or inside a captured CUDA graph (no generator state, no host sync).

The mixer is SplitMix64. Torch has no uint64 arithmetic, so it runs on int64: multiplication
wraps modulo 2**64 exactly as unsigned would, and logical right shifts are arithmetic shifts with
the sign-extended bits masked off.
"""

from __future__ import annotations

import torch


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer of x + golden ratio: int64 → well-mixed int64."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def mix_keys(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor:
    """One key from two (seed, counter); order matters. A Python int stays a scalar operand (no
    host→device copy), so this is safe inside CUDA graph capture."""
    a = torch.as_tensor(a, dtype=torch.int64)
    if not isinstance(b, torch.Tensor):
        b = _signed(b % (1 << 64))
    return mix64(mix64(a) ^ b)


def uniform(keys: torch.Tensor, counter: torch.Tensor | int = 0) -> torch.Tensor:
    """Uniform floats in (0, 1), one per key: float32 from the top 24 bits."""
    z = mix_keys(keys, counter)
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def normal(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Standard normal noise [*keys.shape, n] (Box-Muller), a pure function of each key."""
    idx = torch.arange(n, dtype=torch.int64, device=keys.device)
    k = keys.unsqueeze(-1)
    u1 = uniform(k, 2 * idx)
    u2 = uniform(k, 2 * idx + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)
