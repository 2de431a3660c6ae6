"""`fp8.tiled_linear`: a step's rows through GEMMs of one shape (64 rows, the last tile padded), so
a row's result is the same whatever the step's row count, and equals the plain product."""

from __future__ import annotations

import torch

from programs.blocks import fp8


def test_tiled_rows_equal_the_plain_product_and_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(130, 48, generator=gen)
    x = torch.randn(200, 48, generator=gen)
    first = fp8.tiled_linear(x[:1], weight)
    for m in (1, 2, 63, 64, 65, 129, 200):
        out = fp8.tiled_linear(x[:m], weight)
        assert out.shape == (m, 130)
        torch.testing.assert_close(out, x[:m] @ weight.t(), rtol=1e-5, atol=1e-5)
        assert torch.equal(out[:1], first), m
    assert torch.equal(fp8.tiled_linear(x, weight, rows=16)[:20], fp8.tiled_linear(x[:20], weight, rows=16))
