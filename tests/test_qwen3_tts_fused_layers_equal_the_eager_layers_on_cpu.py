"""Qwen3-TTS's FlashInfer path (`Qwen3TtsLM.fuse`: joint q/k/v and gate/up GEMMs, norms fused with
the residual adds, QK-norm and RoPE in place in the GEMM's output, SiLU-and-mul, the predictor's
attention as one Triton kernel) computes the eager layers' arithmetic: the talker's hidden states
and the predictor's frames agree on CPU float32, with FlashInfer's four kernels played by torch
functions written from their documented contracts and the Triton kernel in Triton's interpreter
(qwen3-tts-tiny). On a GPU the same wiring runs the real kernels (tests/gpu/test_gpu_qwen3_tts_parity.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from programs import get_spec, load_program_class
from tests.conftest import interpreted_kernel
from tests.test_qwen3_tts_one_shape_predictor_equals_the_eager_step import rows


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """out = input / RMS(input) * weight over the last dim; rows [N, D] or heads [N, H, D]."""
    y = _rms(input, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def _fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place: residual += input; input = rmsnorm(residual)."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def _silu_and_mul(x, out=None, enable_pdl=None):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rope(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """In place in query [N, Hq D] and key [N, Hkv D]: rotate-half RoPE with the cache's row of each
    position (cos in its first half, sin in the second)."""
    assert is_neox and cos_sin_cache.dtype == torch.float32
    half = head_size // 2
    cos = cos_sin_cache[positions, :half][:, None, :]
    sin = cos_sin_cache[positions, half:][:, None, :]
    for x in (query, key):
        h = x.view(x.shape[0], -1, head_size)
        a, b = h[..., :half].float(), h[..., half:].float()
        h.copy_(torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.rmsnorm = _rmsnorm
    fake.fused_add_rmsnorm = _fused_add_rmsnorm
    fake.silu_and_mul = _silu_and_mul
    fake.apply_rope_with_cos_sin_cache_inplace = _rope
    monkeypatch.setitem(sys.modules, "flashinfer", fake)


class CausalRows:
    """`Attention` for rows that are one sequence in order: causal attention over the step's rows."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, hq, d = q.shape
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return o.transpose(0, 1)


def _lm():
    program = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    program.load_lm()
    return program.lm


def test_fused_talker_equals_the_eager_one(fake_flashinfer) -> None:
    eager, fused = _lm(), _lm()
    fused.fuse(max_positions=64)
    assert fused.fused and not eager.fused
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, eager.hidden_size, generator=gen)
    pos = torch.arange(12) + 5
    want = eager.backbone(hidden, pos, CausalRows())
    got = fused.backbone(hidden, pos, CausalRows())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_fused_predictor_draws_the_eager_frames(fake_flashinfer) -> None:
    interpreted_kernel("programs.blocks.depth_attention", "depth_attention")  # its attention kernel
    eager, fused = _lm(), _lm()
    fused.fuse(max_positions=64)
    gen = torch.Generator().manual_seed(2)
    for b in (1, 4):  # the kernel in the interpreter: a few rows
        states = torch.randn(b, eager.hidden_size, generator=gen)
        c0 = torch.randint(0, 2048, (b,), generator=gen)
        for temperature in (0.0, 0.9):
            from gpu_worker.runner.sampler import depth_sampler

            a = eager.predict(states, c0, depth_sampler(rows(b, temperature), 16))
            z = fused.predict(states, c0, depth_sampler(rows(b, temperature), 16))
            assert torch.equal(a, z), (b, temperature)


def test_joint_weights_are_views_so_loading_reaches_the_fused_path(fake_flashinfer) -> None:
    lm = _lm()
    lm.fuse(max_positions=16)
    layer = lm.model.layers[0]
    name = "model.layers.0.self_attn.k_proj.weight"
    new = torch.randn_like(layer.self_attn.k_proj.weight)
    lm.load_weights([("talker." + name, new)])
    d = layer.self_attn.q_proj.weight.shape[0]
    assert torch.equal(layer.self_attn.qkv_weight[d : d + new.shape[0]], new)
    assert layer.self_attn.k_proj.weight.data_ptr() == layer.self_attn.qkv_weight[d:].data_ptr()
    p = lm.code_predictor.model.layers[1].mlp
    assert p.up_proj.weight.data_ptr() == lm._gate_up[1][p.gate_proj.weight.shape[0] :].data_ptr()
