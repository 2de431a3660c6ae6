"""Higgs Audio v2 with `--quantization fp8` (higgs-tts-tiny, CPU, the parity test's random
weights): every layer's attention projections and both DualFFN feed-forward paths become float8
weights with per-output-channel scales, everything else keeps its dtype, and a request's greedy
rows are the same alone and among others joining at other steps. Sampled rows are not checked
here: the CPU's float8 GEMM (torch._scaled_mm) rounds a row by the GEMM's row count, which the
GPU's does not (tests/gpu/test_gpu_higgs_tts_clone.py checks cloned requests among others with
fp8 on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from programs.blocks import fp8
from programs.higgs_tts.model import HiggsLM
from tests.conftest import fp8_copy
from tests.test_higgs_tts_parity import CASES, make_prompt, run
from tests.test_higgs_tts_parity import program as bf16_program  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def program(bf16_program):  # noqa: F811
    """higgs-tts-tiny with the parity test's random weights, its projections in float8."""
    return fp8_copy(bf16_program, HiggsLM)


def test_fp8_turns_the_projections_of_both_paths_only(program):
    lm = program.lm
    layer = lm.model.layers[0]
    a = layer.self_attn
    projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
    projections += [
        lin for m in (layer.mlp, layer.audio_mlp) for lin in (m.gate_proj, m.up_proj, m.down_proj)
    ]
    assert all(isinstance(lin.weight, fp8.Fp8Weight) for lin in projections)
    assert isinstance(lm.audio_lm_head.weight, torch.Tensor)
    assert isinstance(layer.audio_input_layernorm.weight, torch.Tensor)


def test_fused_weights_are_the_ones_quantized(bf16_program):  # noqa: F811
    lm = HiggsLM(bf16_program.lm.config)
    lm.load_state_dict(bf16_program.lm.state_dict())
    lm.fuse()
    lm.quantize_fp8()
    assert all(isinstance(w, fp8.Fp8Weight) for w in lm._qkv)
    assert all(isinstance(w, fp8.Fp8Weight) for pair in lm._gate_up for w in pair)
    layer = lm.model.layers[0]
    assert layer.self_attn.q_proj.weight is None and layer.audio_mlp.up_proj.weight is None
    assert isinstance(layer.self_attn.o_proj.weight, fp8.Fp8Weight)


def test_fp8_greedy_rows_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.0)
    text, opts = CASES["d"]
    alone = run(program, [make_prompt(program, "x", text, 50, opts, **sp)]).outputs["x"]
    others = [
        make_prompt(program, r, CASES[r][0], 40, CASES[r][1], temperature=1.0, seed=i)
        for i, r in enumerate("abc")
    ]
    x = make_prompt(program, "x", text, 50, opts, **sp)
    crowd = run(program, [others[0], x, *others[1:]], stagger=True).outputs["x"]
    assert crowd == alone
    assert len(np.unique(np.array(alone[0])[:, 0])) > 5, "audio rows, not a constant"
