"""`--quantization fp8`: a float8 GEMM computes the product of the dequantized operands (so the only
error is the quantization itself, a few percent for e4m3), and the quantization round-trips."""

from __future__ import annotations

import pytest
import torch

from programs import fp8


@pytest.mark.parametrize("m", [1, 3, 40])
def test_fp8_linear_is_the_product_of_its_dequantized_operands(m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(96, 256, generator=gen) * 0.02
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)
    weight = fp8.Fp8Weight(w)
    q, scale = fp8.quantize_rows(x)
    exact = (q.float() * scale) @ weight.dequantize(torch.float32).t()
    y = fp8.linear(x, weight)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 96)
    torch.testing.assert_close(y.float(), exact, rtol=1e-2, atol=1e-3)  # bf16 output rounding only
    rel = (y.float() - x.float() @ w.t()).norm() / (x.float() @ w.t()).norm()
    assert rel < 0.06  # e4m3 keeps 3 mantissa bits: a few percent


def test_fp8_weights_need_gemm_friendly_shapes():
    with pytest.raises(ValueError, match="divisible by 16"):
        fp8.Fp8Weight(torch.randn(10, 256))


def test_plain_weights_pass_through():
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    torch.testing.assert_close(fp8.linear(x, w), x @ w.t())
