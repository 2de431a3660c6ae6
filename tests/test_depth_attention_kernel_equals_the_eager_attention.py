"""A depth transformer's attention as one Triton kernel (programs/blocks/depth_attention.py, what a
GPU runs in the predictor's fused layers) computes the eager arithmetic: per-head RMSNorm of the
queries and keys, rotate-half RoPE at position t, keys and values written to slot t of the local
cache, softmax attention over slots 0..t with grouped queries. Checked in float32 and bfloat16 for
the first, a middle and the last position, groups of two queries and of one, a head dim and a cache
that are not powers of two, rows that are a column slice of wider ones, slots past t that hold NaN
(never read), and rows of a batch computed as they are alone, bit for bit. Run in Triton's
interpreter on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets there)."""

from __future__ import annotations

import pytest
import torch

from programs.blocks.rope import cos_sin_table
from tests.conftest import interpreted_kernel


@pytest.fixture(scope="module")
def depth_attention():
    return interpreted_kernel("programs.blocks.depth_attention", "depth_attention")


def reference(qkv, q_norm, k_norm, eps, cos_sin, keys, values, t):
    """The eager path: norm and RoPE rounded to the rows' dtype as the unfused kernels write them,
    then attention in float32 over slots 0..t (written in place into keys and values)."""
    b, width = qkv.shape
    _, hkv, _, d = keys.shape
    hq = width // d - 2 * hkv
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    cos, sin = cos_sin[t, : d // 2], cos_sin[t, d // 2 :]

    def norm_rope(x, weight, heads):
        x = x.reshape(b, heads, d).float()
        n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(qkv.dtype).float()
        a, c = n[..., : d // 2], n[..., d // 2 :]
        return torch.cat([a * cos - c * sin, c * cos + a * sin], dim=-1).to(qkv.dtype)

    q, k = norm_rope(q, q_norm, hq), norm_rope(k, k_norm, hkv)
    keys[:, :, t] = k
    values[:, :, t] = v.reshape(b, hkv, d)
    kk = keys[:, :, : t + 1].float().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, t+1, D]
    vv = values[:, :, : t + 1].float().repeat_interleave(hq // hkv, dim=1)
    scores = q.float()[:, :, None, :] @ kk.transpose(-1, -2) * d**-0.5  # [B, Hq, 1, t+1]
    return (scores.softmax(-1) @ vv).reshape(b, hq * d).to(qkv.dtype)


def inputs(b, hq, hkv, d, slots, t, dtype, seed):
    """Random q/k/v rows (a column slice of wider rows), norm weights and a cache whose slots
    past t hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    wide = (torch.randn(b, width + 7, generator=gen) * 3).to(dtype)
    qkv = wide[:, 5 : 5 + width]  # row stride 7 past the width
    q_norm = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype)
    k_norm = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype)
    keys = torch.randn(b, hkv, slots, d, generator=gen).to(dtype)
    values = torch.randn(b, hkv, slots, d, generator=gen).to(dtype)
    keys[:, :, t + 1 :] = float("nan")
    values[:, :, t + 1 :] = float("nan")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    return qkv, q_norm, k_norm, 1e-6, cos_sin_table(inv_freq, slots), keys, values


# The interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest), so its bf16
# results sit up to an ulp from the reference's at each rounding: bf16 tolerance.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "hq, hkv, d, slots, t",
    [
        (4, 2, 8, 16, 0),
        (4, 2, 8, 16, 7),
        (4, 2, 8, 16, 15),  # two query heads a key head, every slot seen
        (3, 3, 12, 6, 0),
        (3, 3, 12, 6, 4),  # one a key head; head dim and cache not powers of two
    ],
)
def test_the_kernel_computes_the_eager_attention_and_writes_slot_t(
    depth_attention, dtype, hq, hkv, d, slots, t
):
    qkv, q_norm, k_norm, eps, cos_sin, keys, values = inputs(5, hq, hkv, d, slots, t, dtype, seed=t + d)
    want_keys, want_values = keys.clone(), values.clone()
    want = reference(qkv, q_norm, k_norm, eps, cos_sin, want_keys, want_values, t)
    got_keys, got_values = keys.clone(), values.clone()
    got = depth_attention(qkv, q_norm, k_norm, eps, cos_sin, got_keys, got_values, t)
    assert got.dtype == dtype and got.shape == (5, hq * d)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_keys[:, :, t], want_keys[:, :, t], **TOL[dtype])
    assert torch.equal(got_values[:, :, t], want_values[:, :, t])  # copied, not computed
    others = [s for s in range(slots) if s != t]  # the other slots as they were (NaN past t)
    for cache, before in ((got_keys, keys), (got_values, values)):
        assert torch.allclose(cache[:, :, others], before[:, :, others], rtol=0, atol=0, equal_nan=True)
    assert not got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_output_does_not_depend_on_its_batch(depth_attention, dtype):
    t = 9
    qkv, q_norm, k_norm, eps, cos_sin, keys, values = inputs(6, 4, 2, 8, 16, t, dtype, seed=1)
    batch_keys, batch_values = keys.clone(), values.clone()
    batch = depth_attention(qkv, q_norm, k_norm, eps, cos_sin, batch_keys, batch_values, t)
    for i in range(6):
        k1, v1 = keys[i : i + 1].clone(), values[i : i + 1].clone()
        one = depth_attention(qkv[i : i + 1], q_norm, k_norm, eps, cos_sin, k1, v1, t)
        assert torch.equal(one[0], batch[i])
        assert torch.equal(k1[0, :, t], batch_keys[i, :, t]) and torch.equal(
            v1[0, :, t], batch_values[i, :, t]
        )
    assert len({tuple(r.tolist()) for r in batch.float()}) == 6  # the rows differ
