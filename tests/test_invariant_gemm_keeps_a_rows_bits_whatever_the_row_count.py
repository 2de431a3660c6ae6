"""`--invariant-gemm on` (programs/blocks/invariant_gemm.py): the GEMMs of plain weights in a Triton
kernel whose reduction order depends on the weight's shape alone, so a row's output has the same
bits whatever rows are beside it. Checked in Triton's interpreter on the CPU (TRITON_INTERPRET=1,
which tests/conftest.py sets there), in float32 and float16 (the interpreter has no bfloat16 math):
the product against float64, a row's bits at every row count and position, with a bias, strided and
batched inputs; the routing of `fp8.linear`; the setting. tests/gpu/test_gpu_op_invariance.py checks
the kernel's bits on a GPU and times it; tests/gpu/test_gpu_parity.py checks a request's tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from common.options import parse_role
from programs.blocks import fp8
from tests.conftest import interpreted_kernel


@pytest.fixture(scope="module")
def linear():
    return interpreted_kernel("programs.blocks.invariant_gemm", "linear")


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 70), (5, 130, 200), (70, 33, 64), (130, 300, 129)])
def test_the_product_is_the_float64_ones_within_float32_rounding(linear, m, n, k) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    exact = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(linear(x, w, b).double(), exact, rtol=0, atol=1e-4 * exact.abs().max().item())
    assert torch.allclose(
        linear(x, w).double(), exact - b.double(), rtol=0, atol=1e-4 * exact.abs().max().item()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_row_count_or_its_place(linear, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(150, 96, generator=g).to(dtype), torch.randn(200, 96, generator=g).to(dtype)
    whole = linear(x, w)
    for m in (1, 2, 3, 17, 63, 64, 65, 129, 150):  # one M tile, a tile's edge, several tiles
        assert torch.equal(linear(x[:m], w), whole[:m]), m
    # a row at another place: row 100 as the first of 50 rows, and alone
    assert torch.equal(linear(x[100:], w)[0], whole[100])
    assert torch.equal(linear(x[100:101], w)[0], whole[100])


def test_strided_and_batched_inputs_give_the_contiguous_rows_bits(linear) -> None:
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(70, 256, generator=g), torch.randn(48, 128, generator=g)
    x = wide[:, :128]  # rows 256 apart
    assert torch.equal(linear(x, w), linear(x.contiguous(), w))
    bias = torch.randn(96, generator=g)[::2]  # every other element
    assert torch.equal(linear(x, w, bias), linear(x, w, bias.contiguous()))
    batched = x.contiguous().view(7, 10, 128)
    assert linear(batched, w).shape == (7, 10, 48)
    assert torch.equal(linear(batched, w).view(70, 48), linear(x, w))
    assert linear(x[:0], w).shape == (0, 48)
    with pytest.raises(ValueError, match="columns"):
        linear(x, torch.randn(48, 100))


def test_the_tile_widens_with_the_rows_and_narrows_for_a_narrow_output() -> None:
    from programs.blocks.invariant_gemm import BLOCK_M, MIN_PROGRAMS_PER_SM, block_n

    for sms in (66, 114, 132):
        for n in (48, 1024, 3072, 5120, 16384, 28736, 156940):
            widths = [block_n(n, m, sms) for m in (1, 64, 65, 128, 129, 512, 513, 8192)]
            assert set(widths) <= {16, 32, 64, 128}
            assert widths == sorted(widths), (n, sms)  # never narrower for more rows
            for m, bn in zip((1, 64, 65, 128, 129, 512, 513, 8192), widths, strict=True):
                programs = -(-m // BLOCK_M) * -(-n // bn)
                assert bn == 16 or programs >= MIN_PROGRAMS_PER_SM * sms, (n, m, sms)
    # an H100's (132 SMs) Orpheus-3B shapes: 32 wide for a decode batch, 64 to 512 rows, then 128
    assert [block_n(3072, m, 132) for m in (1, 128, 129, 512, 513)] == [32, 32, 64, 64, 128]


def test_every_tile_width_gives_a_row_the_same_bits(linear) -> None:
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float16):
        x, w = torch.randn(70, 192, generator=g).to(dtype), torch.randn(200, 192, generator=g).to(dtype)
        narrow = linear(x, w, tile_n=16)
        for bn in (32, 64, 128):
            assert torch.equal(linear(x, w, tile_n=bn), narrow), (dtype, bn)


def test_fp8_linear_takes_the_kernel_for_plain_weights_while_it_is_on(linear, monkeypatch) -> None:
    calls = []
    from programs.blocks import invariant_gemm

    def spy(x, weight, bias=None):
        calls.append(weight)
        return linear(x, weight, bias)

    monkeypatch.setattr(invariant_gemm, "linear", spy)
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    try:
        assert fp8.use_invariant_gemm(True)
        got = fp8.linear(x, w)
        assert calls == [w] and torch.allclose(got, F.linear(x, w), atol=1e-4)
        fp8.tiled_linear(x, w, 4)  # row tiles through the kernel too: two tiles
        assert len(calls) == 3
        with fp8.rows_apart(2):  # a mixed step's parts: one GEMM, the kernel keeps each row's bits
            fp8.linear(x, w)
        assert len(calls) == 4
    finally:
        assert not fp8.use_invariant_gemm(False)
    fp8.linear(x, w)
    assert len(calls) == 4  # off: F.linear


def test_the_setting_reaches_the_gpu_worker_and_is_checked() -> None:
    assert parse_role("gpu_worker", ["--model", "orpheus-tiny"], {}).cfg.gpu.invariant_gemm == "off"
    on = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--invariant-gemm", "on"], {})
    assert on.cfg.gpu.invariant_gemm == "on"
    with pytest.raises(SystemExit):
        parse_role("gpu_worker", ["--model", "orpheus-tiny", "--invariant-gemm", "yes"], {})


AOT_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from programs.blocks import invariant_gemm

tile_n = int(sys.argv[1])
names = ["x_ptr", "w_ptr", "bias_ptr", "out_ptr", "M", "N", "K", "x_stride_m", "w_stride_n", "out_stride_m", "bias_stride"]
sig = {n: "*bf16" if n.endswith("ptr") else "i32" for n in names}
sig |= dict.fromkeys(("HAS_BIAS", "IEEE", "BM", "BN", "BK"), "constexpr")
aligned = [i for i, n in enumerate(names) if n not in ("M", "bias_stride")]  # as the JIT sees them
src = ASTSource(
    fn=invariant_gemm._gemm_kernel,
    signature=sig,
    constexprs={"HAS_BIAS": False, "IEEE": False, "BM": 64, "BN": tile_n, "BK": invariant_gemm.BLOCK_K},
    attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
ptx = compiled.asm["ptx"]
print("wgmma.mma_async" in ptx, "cp.async" in ptx, compiled.metadata.shared)
"""


@pytest.mark.parametrize("tile_n", [16, 128])
def test_the_kernel_compiles_for_hopper_with_tensor_cores_and_pipelined_loads(tile_n) -> None:
    """Compiled ahead of time for sm90 (Triton's own ptxas, no GPU needed; in a process of its own,
    away from the interpreter this one runs), as the JIT compiles it for aligned bf16 tensors:
    warpgroup MMAs, and loads copied asynchronously over four stages (the rows' unit stride known
    to the compiler: an unknown one leaves a single buffer)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [sys.executable, "-c", AOT_COMPILE, str(tile_n)], env=env, capture_output=True, text=True, timeout=120
    )
    if run.returncode and ("ptxas" in run.stderr or "No such file" in run.stderr):
        pytest.skip(f"no CUDA toolchain in this Triton: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    wgmma, pipelined, shared = run.stdout.split()
    assert wgmma == "True" and pipelined == "True"
    assert int(shared) >= 4 * 64 * (64 + tile_n) * 2  # four stages of an x and a w tile
