"""The depth-attention kernel (programs/blocks/depth_attention.py) on the GPU, at the Qwen3-TTS 1.7B
code predictor's shapes in bf16 (16 query heads over 8 KV heads of 128, a cache of 16 slots),
against the kernels it replaces in the fused predictor: FlashInfer's per-head RMSNorm and RoPE in
place in the q/k/v GEMM's output, the two cache writes and SDPA with grouped queries.

1. Every position of a depth step at batches 1, 16 and 64, each path over a cache of its own (the
   kernel's starts as NaN, as uninitialized memory would: no slot past t is read): the output and
   the slot written agree within bf16 tolerance.
2. A row's output and slot alone are its bits in a batch of 16.
3. Captured in a CUDA graph (one position, as the depth graphs capture it), a replay over new rows
   gives the eager call's bits.

The model's frames with the kernel: tests/gpu/test_gpu_qwen3_tts_parity.py, its fused cases
(graphs against eager, a request alone and among others).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from common.graphs import capture
from programs import get_spec
from programs.blocks.rope import cos_sin_table, llama3_inv_freq
from programs.qwen3_tts.program import CONFIG_DIR

SLOTS = 16


@pytest.fixture(scope="module")
def shapes():
    """(hq, hkv, d, eps, cos_sin [16, d] float32) of the 1.7B CustomVoice predictor."""
    with open(os.path.join(CONFIG_DIR, get_spec("qwen3-tts")["lm_config"])) as f:
        pc = json.load(f)["talker_config"]["code_predictor_config"]
    d = pc["head_dim"]
    cos_sin = cos_sin_table(llama3_inv_freq(pc, d).cuda(), SLOTS)
    return pc["num_attention_heads"], pc["num_key_value_heads"], d, pc["rms_norm_eps"], cos_sin


@pytest.fixture(scope="module")
def depth_attention():
    from programs.blocks.depth_attention import depth_attention

    return depth_attention


def unfused(qkv, q_norm, k_norm, eps, cos_sin, keys, values, t, hq, hkv, d):
    """The replaced path, as `_predictor_position_fused` ran it: in place in qkv, then SDPA."""
    import flashinfer

    b = qkv.shape[0]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    for rows, weight in ((q, q_norm), (k, k_norm)):
        heads = rows.view(b, -1, d)
        flashinfer.rmsnorm(heads, weight, eps, out=heads)
    pos = torch.full((b,), t, dtype=torch.int64, device=qkv.device)
    flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cos_sin, is_neox=True)
    keys[:, :, t] = k.view(b, hkv, d)
    values[:, :, t] = v.view(b, hkv, d)
    o = F.scaled_dot_product_attention(
        q.view(b, hq, 1, d), keys[:, :, : t + 1], values[:, :, : t + 1], enable_gqa=hq != hkv
    )
    return o.reshape(b, hq * d)


def norm_weights(d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = 1 + 0.5 * torch.randn(2, d, generator=gen, device="cuda")
    return w[0].to(torch.bfloat16), w[1].to(torch.bfloat16)


def test_every_position_agrees_with_flashinfer_and_sdpa(shapes, depth_attention, gpu_report):
    pytest.importorskip("flashinfer")
    hq, hkv, d, eps, cos_sin = shapes
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_norm, k_norm = norm_weights(d, gen)
    width = (hq + 2 * hkv) * d
    res: dict[str, dict] = {}
    gpu_report("depth-attention")["kernel_vs_flashinfer_sdpa"] = res
    for b in (1, 16, 64):
        keys = torch.full((b, hkv, SLOTS, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        values = torch.full_like(keys, float("nan"))
        ref_keys, ref_values = torch.zeros_like(keys), torch.zeros_like(values)
        worst = {"o_max_abs": 0.0, "o_ref_abs_max": 0.0, "slot_max_abs": 0.0}
        for t in range(SLOTS):
            qkv = (2 * torch.randn(b, width, generator=gen, device="cuda")).to(torch.bfloat16)
            got = depth_attention(qkv, q_norm, k_norm, eps, cos_sin, keys, values, t)
            want = unfused(qkv.clone(), q_norm, k_norm, eps, cos_sin, ref_keys, ref_values, t, hq, hkv, d)
            assert not got.isnan().any(), (b, t)
            worst["o_max_abs"] = max(worst["o_max_abs"], float((got.float() - want.float()).abs().max()))
            worst["o_ref_abs_max"] = max(worst["o_ref_abs_max"], float(want.float().abs().max()))
            slot = (keys[:, :, t].float() - ref_keys[:, :, t].float()).abs().max()
            worst["slot_max_abs"] = max(worst["slot_max_abs"], float(slot))
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(keys[:, :, t], ref_keys[:, :, t], rtol=1e-2, atol=1e-2)
            assert torch.equal(values[:, :, t], ref_values[:, :, t])
        res[f"batch {b}"] = worst


def test_a_rows_bits_do_not_depend_on_its_batch(shapes, depth_attention):
    hq, hkv, d, eps, cos_sin = shapes
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_norm, k_norm = norm_weights(d, gen)
    b, t = 16, 11
    keys = torch.randn(b, hkv, SLOTS, d, generator=gen, device="cuda").to(torch.bfloat16)
    values = torch.randn(b, hkv, SLOTS, d, generator=gen, device="cuda").to(torch.bfloat16)
    qkv = (2 * torch.randn(b, (hq + 2 * hkv) * d, generator=gen, device="cuda")).to(torch.bfloat16)
    batch_keys, batch_values = keys.clone(), values.clone()
    batch = depth_attention(qkv, q_norm, k_norm, eps, cos_sin, batch_keys, batch_values, t)
    for i in range(b):
        k1, v1 = keys[i : i + 1].clone(), values[i : i + 1].clone()
        one = depth_attention(qkv[i : i + 1], q_norm, k_norm, eps, cos_sin, k1, v1, t)
        assert torch.equal(one[0], batch[i]), i
        assert torch.equal(k1[0], batch_keys[i]) and torch.equal(v1[0], batch_values[i]), i


def test_a_captured_position_replays_the_eager_bits(shapes, depth_attention):
    hq, hkv, d, eps, cos_sin = shapes
    gen = torch.Generator(device="cuda").manual_seed(2)
    q_norm, k_norm = norm_weights(d, gen)
    b, t = 16, 5
    width = (hq + 2 * hkv) * d
    qkv = torch.zeros(b, width, dtype=torch.bfloat16, device="cuda")
    keys = torch.randn(b, hkv, SLOTS, d, generator=gen, device="cuda").to(torch.bfloat16)
    values = torch.randn(b, hkv, SLOTS, d, generator=gen, device="cuda").to(torch.bfloat16)
    before = keys.clone(), values.clone()
    graph, out = capture(
        lambda: depth_attention(qkv, q_norm, k_norm, eps, cos_sin, keys, values, t),
        torch.cuda.graph_pool_handle(),
    )
    for _ in range(2):
        qkv.copy_((2 * torch.randn(b, width, generator=gen, device="cuda")).to(torch.bfloat16))
        k1, v1 = before[0].clone(), before[1].clone()
        want = depth_attention(qkv, q_norm, k_norm, eps, cos_sin, k1, v1, t)
        graph.replay()
        assert torch.equal(out, want)
        assert torch.equal(keys, k1) and torch.equal(values, v1)
