"""`--quantization fp8`: a float8 GEMM computes the product of the dequantized operands (so the only
error is the quantization itself, a few percent for e4m3), and the quantization round-trips."""

from __future__ import annotations

import pytest
import torch

from programs.blocks import fp8


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


def test_rows_apart_splits_only_gemms_whose_rows_round_by_their_count(monkeypatch):
    """A mixed step's prompt and decode rows: two GEMMs for a bf16 weight, one for a float8 weight
    (its GEMMs give a row the same bits at any row count on the H200), with the same result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, generator=gen).to(torch.bfloat16)
    plain = (torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16)
    weights = {"bf16": plain, "fp8": fp8.Fp8Weight(plain)}
    whole = {name: fp8.linear(x, w) for name, w in weights.items()}
    calls = []
    real = fp8._linear
    monkeypatch.setattr(fp8, "_linear", lambda a, w, b: calls.append(a.shape[0]) or real(a, w, b))
    with fp8.rows_apart(5):
        split = {name: fp8.linear(x, w) for name, w in weights.items()}
    assert calls == [5, 7, 12]
    assert torch.equal(split["fp8"], whole["fp8"])
    assert torch.equal(split["bf16"][:5], fp8.linear(x[:5], plain))
    assert torch.equal(split["bf16"][5:], fp8.linear(x[5:], plain))
