"""FP8 (e4m3) linear layers for the GPU path, as an option (`--quantization fp8`).

Weights are quantized once, per output channel (scale = row max / 448); activations per row at
run time; each GEMM is one `torch._scaled_mm` with row-wise scales and a bf16 result (Hopper fp8
tensor cores). Halves the weight bytes a decode step reads and doubles the GEMM rate; costs a
few small kernels per GEMM to quantize the activations, which `compile_quantizer` fuses into one
when torch.compile works on the machine.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class Fp8Weight:
    """A [N, K] weight as float8 values [N, K] and per-output-channel scales [1, N] float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            raise ValueError(f"fp8 GEMMs need both weight dims divisible by 16, got {tuple(weight.shape)}")
        amax = weight.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)  # [N, 1]
        self.q = (weight.float() * (FP8_MAX / amax)).to(FP8)  # [N, K]
        self.scale = (amax / FP8_MAX).t().contiguous()  # [1, N]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale.t()).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (float8 [M, K], scale [M, 1] float32) with x ≈ q * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(FP8), scale


_quantizer = quantize_rows


def compile_quantizer(device: torch.device, widths: tuple[int, ...] = (256,)) -> bool:
    """Fuse `quantize_rows` into one kernel with torch.compile if this machine can (Triton);
    keep the eager version otherwise. Returns whether the compiled one is in use. `widths`: the
    row lengths (K) it will see, compiled here (not later inside a CUDA graph capture). The row
    count is dynamic, the width static: with both dynamic, inductor looped over each
    row in small blocks, 12 µs a call on the H200 at any batch, which cost an fp8 step more than
    its GEMMs saved (bench/results/h200-fp8-gemm.json)."""
    global _quantizer
    # Dynamo counts every compile of one code object together (8 by default) and, under fullgraph,
    # fails a compile past the limit outright. Each call compiles `quantize_rows` anew, two for
    # each width (one row, any rows): a process that loads several models or engines (a test
    # session, the op-invariance bench beside them) would run out.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    try:
        compiled = torch.compile(quantize_rows, dynamic=False, fullgraph=True)

        def fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            torch._dynamo.maybe_mark_dynamic(x, 0)
            return compiled(x)

        for k in widths:
            for m in (1, 2, 24):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                q, s = fused(x)
                ref_q, ref_s = quantize_rows(x)
                if not (torch.equal(q.float(), ref_q.float()) and torch.allclose(s, ref_s)):
                    raise RuntimeError("compiled fp8 quantizer differs from the eager one")
    except Exception as e:  # no Triton, no compiler: the eager quantizer is correct, only slower
        log.warning("fp8: torch.compile of the activation quantizer failed (%s); using eager", e)
        return False
    _quantizer = fused
    return True


def quantize_linears(linears, widths) -> None:
    """Each module's `weight` (a [N, K] parameter) to an `Fp8Weight` in place, so `linear` runs it
    in float8 (one-way; a module's bias is not taken into the GEMM: its caller adds it); on a GPU
    the activation quantizer then compiled for the row `widths` (K) those GEMMs see."""
    device = None
    for lin in linears:
        weight = lin.weight
        device = weight.device
        del lin.weight  # a parameter's name takes only parameters
        lin.weight = Fp8Weight(weight)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
        compile_quantizer(device, tuple(sorted(set(widths))))


_rows_apart = 0


@contextlib.contextmanager
def rows_apart(rows: int):
    """Within: every `linear` of a plain (bf16) weight runs its first `rows` rows and the rest as
    two GEMMs. A bf16 GEMM's result for a row can depend on how many rows it holds (the library
    picks its kernel by shape: measured on the H200, a prompt prefilled beside decode rows in one
    GEMM changed a greedy request's tokens), so a step that runs a prompt with decode rows
    (the gpu_worker's mixed graphs) keeps each part in a GEMM of the size it has in a step of its
    own. The float8 GEMMs, and plain ones in the row-invariant kernel (`use_invariant_gemm`), give
    a row the same bits at any row count (bench/op_invariance.py, every
    Orpheus-3B shape on the H200: 1-512 rows, and one GEMM over a prompt bucket's 32-128 rows with a
    decode bucket's 1-512 against a GEMM per part): they run the step's rows as one, which spares
    reading every weight a second time for the prompt (~1.8 ms of the 3.3 ms a prompt added to a
    step of 384 streams, bench/profile_step.py)."""
    global _rows_apart
    before, _rows_apart = _rows_apart, rows
    try:
        yield
    finally:
        _rows_apart = before


_row_tile = 0
_invariant: list = [None]  # invariant_gemm.linear while `use_invariant_gemm(True)`


def use_invariant_gemm(on: bool) -> bool:
    """Run every GEMM of a plain (not float8) weight through `invariant_gemm.linear` (on), whose
    result for a row does not depend on the row count, or through F.linear (off, the default):
    process-wide, set before any CUDA graph captures one (`--invariant-gemm`). → whether it is on
    (False where Triton does not import)."""
    _invariant[0] = None
    if on:
        try:
            from programs.blocks.invariant_gemm import linear as invariant
        except ImportError:
            return False
        _invariant[0] = invariant
    return invariant_gemm_on()


def invariant_gemm_on() -> bool:
    """Whether the GEMMs of plain weights run in the row-invariant kernel (`use_invariant_gemm`)."""
    return _invariant[0] is not None


@contextlib.contextmanager
def row_tiles(rows: int):
    """Within (rows > 0): every `linear` runs its input in GEMMs of exactly `rows` rows
    (`tiled_linear`), so a row's result has the same bits whatever the row count: the decode
    graphs' way to batch invariance where a GEMM library picks its kernel by the row count
    (`--decode-row-tile`). 0: each input as one GEMM."""
    global _row_tile
    before, _row_tile = _row_tile, rows
    try:
        yield
    finally:
        _row_tile = before


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) → [M, N] in x's dtype; weight a plain tensor or an `Fp8Weight`."""
    if _row_tile:
        return tiled_linear(x, weight, _row_tile, bias)
    if 0 < _rows_apart < x.shape[0] and not isinstance(weight, Fp8Weight) and _invariant[0] is None:
        s = _rows_apart
        return torch.cat([_linear(x[:s], weight, bias), _linear(x[s:], weight, bias)])
    return _linear(x, weight, bias)


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, rows: int = 64, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T → [M, N] as GEMMs of exactly `rows` rows each (the last tile padded with
    zeros): every row goes through one GEMM shape whatever M is, so its bits do not depend on how
    many rows the step holds (a GEMM library picks its kernel and its split by shape). For a small
    output head whose rows are a step's requests: a step of many rows costs ⌈M / rows⌉ GEMMs of one
    weight read each, where one GEMM of M rows would round a row by M."""
    m = x.shape[0]
    if m % rows:
        x = torch.cat([x, x.new_zeros(rows - m % rows, x.shape[1])])
    return torch.cat([_linear(t, weight, bias) for t in x.split(rows)])[:m]


def _linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(weight, Fp8Weight):
        if _invariant[0] is not None:
            return _invariant[0](x, weight, bias)
        return F.linear(x, weight, bias)
    if bias is not None:
        raise ValueError("fp8 linear layers have no bias")
    q, scale = _quantizer(x)
    return torch._scaled_mm(q, weight.q.t(), scale_a=scale, scale_b=weight.scale, out_dtype=x.dtype)
