"""A depth transformer's attention for one position in one Triton kernel on a GPU: QK-norm, RoPE,
the write of the position's key and value into the local cache, and attention over the cache.

A depth transformer (a code predictor: a few layers run once per codebook of every frame) attends
over a cache of at most a few dozen slots, one position per row at a time. Between its q/k/v GEMM
and its output projection, torch and FlashInfer take some six kernels a layer (two RMSNorms, RoPE,
two cache writes, SDPA) that each do almost nothing; a decode step runs them for every layer and
position, hundreds of launches that bound the step at small batches. Here one program per (row,
KV head) does all of it, with the head's G = Hq / Hkv query heads:

- the key and value of the head are read from the q/k/v GEMM's output row (q, k and v are its
  column slices; the row may be a slice of a wider one, so its stride is the kernel's argument);
- the key gets its per-head RMSNorm (float32, weight `k_norm`), then rotate-half RoPE at position
  t from a float32 cos/sin table (cos in a row's first half, sin in its second: FlashInfer's
  `cos_sin_cache` layout, `rope.cos_sin_table`), and is written with the value to slot t;
- each query head gets its RMSNorm (`q_norm`) and RoPE the same way, then attention over slots
  0..t: scores scaled by D**-0.5, softmax in float32, the values' sum in float32, written in the
  output's dtype.

The normed and the rotated heads are rounded to the rows' dtype where the unfused kernels round
them (each writes its result back into the GEMM's output), so the cache holds what those write;
what remains apart is the attention's summation order (bf16 tolerance, not bitwise). Slot t's key
and value come from registers, not from the cache just written (no read-after-write within a
program); slots past t are never read. Each row is its own programs, so a row's bits do not depend
on its batch. t is a runtime argument (not specialized), so one compile serves every position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_rope(
    x1, x2, w_ptr, half, inside, eps, cos, sin, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr
):
    """A head's halves x1, x2 [BLOCK_HALF] float32 → RMSNorm with weight w then rotate-half RoPE,
    each step rounded to DT (returned as float32)."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(w_ptr + half, mask=inside, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + half, mask=inside, other=0.0).to(tl.float32)
    n1 = (x1 * rstd * w1).to(DT).to(tl.float32)
    n2 = (x2 * rstd * w2).to(DT).to(tl.float32)
    r1 = (n1 * cos - n2 * sin).to(DT).to(tl.float32)
    r2 = (n2 * cos + n1 * sin).to(DT).to(tl.float32)
    return r1, r2


@triton.jit(do_not_specialize=["t"])
def _depth_attention_kernel(
    qkv_ptr,
    qkv_stride,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    cos_sin_ptr,
    keys_ptr,
    values_ptr,
    cache_stride_b,
    cache_stride_h,
    cache_stride_c,
    out_ptr,
    out_stride,
    t,
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    DT: tl.constexpr = qkv_ptr.dtype.element_ty
    half = tl.arange(0, BLOCK_HALF)
    inside = half < HALF
    cos = tl.load(cos_sin_ptr + t * D + half, mask=inside, other=0.0)
    sin = tl.load(cos_sin_ptr + t * D + HALF + half, mask=inside, other=0.0)
    row = qkv_ptr + b * qkv_stride

    # This head's key (normed, rotated) and value into slot t.
    k_at = row + (G * HKV + h) * D
    k1 = tl.load(k_at + half, mask=inside, other=0.0).to(tl.float32)
    k2 = tl.load(k_at + HALF + half, mask=inside, other=0.0).to(tl.float32)
    k1, k2 = _rms_rope(k1, k2, k_norm_ptr, half, inside, eps, cos, sin, D, HALF, DT)
    v_at = row + (G * HKV + HKV + h) * D
    v1 = tl.load(v_at + half, mask=inside, other=0.0).to(tl.float32)
    v2 = tl.load(v_at + HALF + half, mask=inside, other=0.0).to(tl.float32)
    cache = b * cache_stride_b + h * cache_stride_h
    k_t, v_t = keys_ptr + cache + t * cache_stride_c, values_ptr + cache + t * cache_stride_c
    tl.store(k_t + half, k1.to(keys_ptr.dtype.element_ty), mask=inside)
    tl.store(k_t + HALF + half, k2.to(keys_ptr.dtype.element_ty), mask=inside)
    tl.store(v_t + half, v1.to(values_ptr.dtype.element_ty), mask=inside)
    tl.store(v_t + HALF + half, v2.to(values_ptr.dtype.element_ty), mask=inside)

    # Slots 0..t-1 from the cache, slot t from registers: [BLOCK_C, BLOCK_HALF] each half.
    slots = tl.arange(0, BLOCK_C)
    before = (slots < t)[:, None] & inside[None, :]
    at = (slots == t)[:, None]
    tile = cache + slots[:, None] * cache_stride_c + half[None, :]
    kc1 = tl.load(keys_ptr + tile, mask=before, other=0.0).to(tl.float32)
    kc2 = tl.load(keys_ptr + tile + HALF, mask=before, other=0.0).to(tl.float32)
    vc1 = tl.load(values_ptr + tile, mask=before, other=0.0).to(tl.float32)
    vc2 = tl.load(values_ptr + tile + HALF, mask=before, other=0.0).to(tl.float32)
    kc1, kc2 = tl.where(at, k1[None, :], kc1), tl.where(at, k2[None, :], kc2)
    vc1, vc2 = tl.where(at, v1[None, :], vc1), tl.where(at, v2[None, :], vc2)
    seen = slots <= t

    # The head's query heads h·G .. h·G + G - 1 (grouped-query attention's order).
    for g in tl.static_range(G):
        qh = h * G + g
        q1 = tl.load(row + qh * D + half, mask=inside, other=0.0).to(tl.float32)
        q2 = tl.load(row + qh * D + HALF + half, mask=inside, other=0.0).to(tl.float32)
        q1, q2 = _rms_rope(q1, q2, q_norm_ptr, half, inside, eps, cos, sin, D, HALF, DT)
        s = (tl.sum(kc1 * q1[None, :], axis=1) + tl.sum(kc2 * q2[None, :], axis=1)) * scale  # [BLOCK_C]
        s = tl.where(seen, s, float("-inf"))
        e = tl.exp(s - tl.max(s, axis=0))
        p = e / tl.sum(e, axis=0)
        o1 = tl.sum(p[:, None] * vc1, axis=0)
        o2 = tl.sum(p[:, None] * vc2, axis=0)
        o_at = out_ptr + b * out_stride + qh * D
        tl.store(o_at + half, o1.to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(o_at + HALF + half, o2.to(out_ptr.dtype.element_ty), mask=inside)


def depth_attention(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    t: int,
) -> torch.Tensor:
    """One position's attention. qkv [B, (Hq + 2 Hkv) D]: the q/k/v GEMM's output rows (a column
    slice of wider rows is fine: unit column stride), q_norm / k_norm [D] the per-head RMSNorm
    weights (one eps), cos_sin [P > t, D] float32 (`rope.cos_sin_table`), keys / values
    [B, Hkv, C > t, D] the local cache (unit last stride, the same strides), t the position (an int,
    so a graph captures one position) → o [B, Hq D] in qkv's dtype; keys and values get slot t."""
    b, width = qkv.shape
    _, hkv, slots, d = keys.shape
    hq = width // d - 2 * hkv
    if width != (hq + 2 * hkv) * d or hq <= 0 or hq % hkv or d % 2:
        raise ValueError(f"q/k/v rows of {width} do not hold {hkv} KV heads of {d} and their queries")
    if not 0 <= t < slots or cos_sin.shape[0] <= t or cos_sin.shape[1] != d or cos_sin.dtype != torch.float32:
        raise ValueError(f"position {t}: the cache has {slots} slots, cos_sin is {tuple(cos_sin.shape)}")
    same = (values.shape, values.stride(), values.dtype) == (keys.shape, keys.stride(), keys.dtype)
    if keys.shape[0] != b or keys.dtype != qkv.dtype or not same:
        raise ValueError("keys and values [B, Hkv, C, D] alike, in the rows' dtype")
    if qkv.stride(1) != 1 or keys.stride(3) != 1:
        raise ValueError("qkv's columns and the cache's head dim must have unit stride")
    out = qkv.new_empty(b, hq * d)
    _depth_attention_kernel[(b, hkv)](
        qkv,
        qkv.stride(0),
        q_norm,
        k_norm,
        eps,
        cos_sin.contiguous(),
        keys,
        values,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        out,
        out.stride(0),
        t,
        d**-0.5,
        HKV=hkv,
        G=hq // hkv,
        D=d,
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_C=triton.next_power_of_2(slots),
    )
    return out
