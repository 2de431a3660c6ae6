"""Chatterbox with `--quantization fp8` (chatterbox-tiny, CPU, random weights): T3's backbone
projections become float8 weights with per-output-channel scales, everything else keeps its dtype,
and a request's greedy tokens with guidance are the same alone and among others joining at other
steps. Sampled tokens are not checked here: the CPU's float8 GEMM (torch._scaled_mm) rounds a row
by the GEMM's row count, which the GPU's does not; tests/gpu/test_gpu_chatterbox_parity.py checks
fp8 greedy and sampled tokens among 3 and 11 others on the GPU."""

from __future__ import annotations

import pytest
import torch

from programs.blocks import fp8
from programs.chatterbox.model import T3LM
from tests.conftest import fp8_copy
from tests.test_chatterbox_parity import CASES, make_prompt, run
from tests.test_chatterbox_parity import program as bf16_program  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def program(bf16_program):  # noqa: F811
    """chatterbox-tiny with the parity test's random weights, its backbone in float8."""
    return fp8_copy(bf16_program, T3LM)


def test_fp8_turns_the_backbones_projections_only(program):
    lm = program.lm
    layer = lm.tfmr.layers[0]
    a, m = layer.self_attn, layer.mlp
    projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    assert all(isinstance(lin.weight, fp8.Fp8Weight) for lin in projections)
    assert isinstance(lm.speech_head.weight, torch.Tensor) and isinstance(lm.speech_emb.weight, torch.Tensor)
    assert isinstance(layer.input_layernorm.weight, torch.Tensor)


def test_fp8_greedy_tokens_with_guidance_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.0)
    text, opts = CASES["d"]
    alone = run(
        program, [make_prompt(program, "x", text, 40, opts, repetition_penalty=1.2, min_tokens=30, **sp)]
    )
    others = [
        make_prompt(program, r, CASES[r][0], 30, CASES[r][1], temperature=1.0, seed=i)
        for i, r in enumerate("abc")
    ]
    x = make_prompt(program, "x", text, 40, opts, repetition_penalty=1.2, min_tokens=30, **sp)
    crowd = run(program, [others[0], x, *others[1:]], stagger=True)
    assert alone.outputs["x"] == crowd.outputs["x"]
    assert len(set(alone.outputs["x"][0])) > 5, "speech tokens, not a constant"
