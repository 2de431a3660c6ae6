"""A GEMM whose result for a row does not depend on how many rows it holds (Triton, on a GPU).
It serves every GEMM that goes through `programs.blocks.fp8.linear` (a model's backbone and heads;
Qwen3-TTS's code predictor too; a program whose GEMMs all do says so with `mixed_prefill`); a
program's own `F.linear` calls stay the library's.

A GEMM library picks its kernel, its tile and its split of the reduction by the problem's shape, so
one row of `x @ w.T` can round differently in a batch of 24 rows than alone: on an H100 cuBLAS's
bf16 GEMMs of Orpheus-3B's shapes do from 16 rows, and a greedy request's tokens among 17 others
part from its own at the first decode token (docs/performance.md, "Batch invariance"). Float8
GEMMs do not, which is why a request's tokens are its own in any batch with `--quantization fp8`;
this kernel gives plain (bf16, fp16, fp32) weights the same property without reading the weights
once per tile of rows (`--decode-row-tile`).

How the bits stay a row's own:

- Every output element is the same sequence of `tl.dot` steps over the same BLOCK_K chunks of K,
  accumulated in float32 in the same order, whatever M is: the reduction is chosen from K alone.
- A program computes one BLOCK_M × BLOCK_N tile over the whole of K (no split of K, so no second
  reduction whose order could depend on anything); rows past M load zeros and are not stored, and
  a row's dot products never mix with another row's.
- The tile's width, BLOCK_N, follows M (`block_n`): it decides which outputs a program computes,
  not how any one of them is summed (each element's MMA k-steps are its own), so a row has the
  same bits at every BLOCK_N: checked in the interpreter and on a GPU (tests/gpu/
  test_gpu_op_invariance.py), where the served shapes' rows are compared across row counts that
  take different widths.
- M is not specialized (`do_not_specialize`), so one compiled kernel per width serves every row count.

Speed: consecutive programs take the M tiles of one N tile, so at a large M the weight tile each
reads comes from L2 after the first (about one pass over the weights per GEMM, where row tiles
read them once per tile). A decode batch of one or two M tiles reads the weights in narrow N tiles
(many programs, each a short stream of loads), a larger batch in wider ones (fewer loads of x per
weight, more MMA work per load); an N too narrow to give the SMs enough programs narrows further.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # one Hopper warpgroup's MMA height
BLOCK_K = 64


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride_m,
    w_stride_n,
    out_stride_m,
    bias_stride,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    pid_n = pid // tiles_m  # the M tiles of one N tile run next to each other: its weights from L2
    pid_m = pid % tiles_m
    # int64: a row's or a weight's offset passes 2^31 elements in a large GEMM (a vocabulary's head)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    # Rows of x and of the weight are contiguous (`linear` sees to it): loads the compiler knows are
    # contiguous, vectorized and pipelined over `num_stages` (an unknown stride serializes them)
    x_ptrs = x_ptr + rm[:, None] * x_stride_m + rk[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rn[None, :] * w_stride_n + rk[:, None]  # [BK, BN]: w.T's tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0.0)
        if IEEE:  # float32 weights: float32 products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn * bias_stride, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * out_stride_m + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# BLOCK_N by the row count's M tiles: up to 2 tiles (128 rows) 32, up to 8 (512 rows) 64, then 128
# (measured on an H100 against the other widths, `gemm_ms` in `voxpipe bench op-invariance`)
WIDTH_BY_M_TILES = ((2, 32), (8, 64))
MIN_PROGRAMS_PER_SM = 0.5  # narrower than its width where an N tile row would leave SMs idle


def block_n(n: int, m: int, sms: int) -> int:
    """BLOCK_N for an [m, K] @ [K, n] product on a GPU of `sms` SMs: by m's M tiles
    (`WIDTH_BY_M_TILES`; 128 past them), halved (down to 16) while the programs of the output,
    ⌈m / BLOCK_M⌉ × ⌈n / BLOCK_N⌉, number fewer than MIN_PROGRAMS_PER_SM per SM."""
    tiles_m = triton.cdiv(max(m, 1), BLOCK_M)
    bn = next((w for most, w in WIDTH_BY_M_TILES if tiles_m <= most), 128)
    while bn > 16 and tiles_m * triton.cdiv(n, bn) < MIN_PROGRAMS_PER_SM * sms:
        bn //= 2
    return bn


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # Triton's interpreter on a CPU (tests): an H100's count, so tiles are as served


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile_n: int = 0
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) → [..., N] in x's dtype, each row's bits its own
    whatever the row count (F.linear's contract otherwise; float32 accumulation). `tile_n`: a
    BLOCK_N other than `block_n`'s (a benchmark's sweep; 0: `block_n`'s)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bn = tile_n or block_n(n, m, _sms(x.device))
        _gemm_kernel[(triton.cdiv(m, BLOCK_M) * triton.cdiv(n, bn),)](
            rows,
            weight,
            bias if bias is not None else weight,  # unread without a bias
            out,
            m,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            out.stride(0),
            bias.stride(0) if bias is not None else 0,
            HAS_BIAS=bias is not None,
            IEEE=weight.dtype == torch.float32,
            BM=BLOCK_M,
            BN=bn,
            BK=BLOCK_K,
            num_warps=4,
            num_stages=4,
        )
    return out.view(*x.shape[:-1], n)
