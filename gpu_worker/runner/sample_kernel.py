"""The sampler's tail in one Triton kernel on a GPU: temperature, sort, top-k, softmax, top-p,
min-p and the inverse-CDF draw of `sampler.sample_rows`, one program per row.

In torch that tail is some twenty-five kernels (a sort alone is several), and a depth step runs it
once per codebook: for a model of sixteen codebooks, hundreds of launches a step, which bound the
step at small batches. Here each row is one program that holds its whole row in registers:

- the row (logits / max(temperature, 1e-5)) is sorted descending with its column indices packed
  under each value (the float's bits made order-preserving, the index below them, so equal values
  keep the lower column first);
- ranks at or past top-k (0: off) are masked, the softmax, then its running sum drops a token when
  the tokens ranked above it already hold top-p of the mass (top-p 1: none), or when it holds less
  than min-p of the first token's;
- the draw is the first rank whose running mass reaches u times the total (`searchsorted`'s
  left side), u the row's counter-based uniform number; a greedy row (temperature 0) takes the
  first column of the row's maximum (`argmax`).

Same rules, same random numbers, another summation than torch's (float here, integers of 2^-32
there: `sampler.fixed_mass`): on a GPU the sampled ids equal torch's but where u falls within
rounding of a bucket edge. Every row is computed by its own program, so a row's id does not depend
on its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(
    logits_ptr,
    row_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    u_stride,
    out_ptr,
    V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < V
    raw = tl.load(logits_ptr + r * row_stride + cols, mask=inside, other=float("-inf"))
    greedy = tl.argmax(raw, axis=0)
    temp = tl.load(temperature_ptr + r)
    x = raw / tl.maximum(temp, 1e-5)
    # Order-preserving integer of each float (negatives' magnitude bits flipped), the column below
    # it, complemented so that a descending sort puts the lower column first among equal values.
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    packed = (key.to(tl.int64) << 32) | (BLOCK - 1 - cols).to(tl.int64)
    packed = tl.sort(packed, descending=True)
    order = (BLOCK - 1 - (packed & 0xFFFFFFFF)).to(tl.int32)
    kbits = (packed >> 32).to(tl.int32)
    s = tl.where(kbits >= 0, kbits, kbits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    k = tl.load(top_k_ptr + r)
    k = tl.where(k > 0, k, V)
    s = tl.where(cols < k, s, float("-inf"))
    e = tl.exp(s - tl.max(s, axis=0))
    probs = e / tl.sum(e, axis=0)
    mass_before = tl.cumsum(probs, axis=0) - probs
    first = tl.max(probs, axis=0)  # the first rank's, the largest
    top_p = tl.load(top_p_ptr + r)
    top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # 1: drops none
    drop = (mass_before > top_p) | (probs < tl.load(min_p_ptr + r) * first)
    probs = tl.where(drop, 0.0, probs)
    cdf = tl.cumsum(probs, axis=0)
    u = tl.load(u_ptr + r * u_stride) * tl.max(cdf, axis=0)  # the scan's last value, as torch's cdf[-1]
    pick = tl.minimum(tl.sum((cdf < u).to(tl.int32), axis=0), V - 1)
    sampled = tl.sum(tl.where(cols == pick, order, 0), axis=0)
    choice = tl.where(temp > 0, sampled, greedy.to(tl.int32))
    tl.store(out_ptr + r, choice.to(tl.int64))


def sample_tail(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] float32 (rows contiguous), the rows' settings [B] and uniform numbers u [B]
    (any stride) → ids [B] int64."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(v)
    _sample_kernel[(b,)](
        logits,
        logits.stride(0),
        temperature.contiguous(),
        top_k.contiguous(),
        top_p.contiguous(),
        min_p.contiguous(),
        u,
        u.stride(0),
        out,
        v,
        BLOCK=block,
        num_warps=16 if block >= 2048 else 8 if block >= 512 else 4,  # the sort's exchanges spread wider
    )
    return out
