"""`--fused-step` (off by default) reaches the gpu_worker's settings and is checked; a program without
fused layers, or off a GPU, says it did not fuse and keeps its eager layers; the sampler's Triton
tail is off until `use_tail_kernel(True)` and off again after `use_tail_kernel(False)`, and a CPU
row never takes it."""

from __future__ import annotations

import pytest
import torch

from common.config import GpuWorkerSettings
from common.options import parse_role
from gpu_worker.runner import sampler
from programs import get_spec, load_program_class


def test_the_option_is_off_by_default_and_checked():
    assert GpuWorkerSettings().fused_step == "off"
    assert parse_role("gpu_worker", ["--fused-step", "on"], {}).cfg.gpu.fused_step == "on"
    assert parse_role("gpu_worker", [], {"VOXPIPE_FUSED_STEP": "on"}).cfg.gpu.fused_step == "on"
    with pytest.raises(ValueError, match="--fused-step"):
        GpuWorkerSettings(fused_step="yes").check()


@pytest.mark.parametrize("model", ["qwen3-tts-tiny", "orpheus-tiny"])
def test_off_a_gpu_no_program_fuses(model):
    program = load_program_class(model)(get_spec(model), load_format="dummy")
    program.load_lm()
    assert program.fuse_layers() is False
    assert not getattr(program.lm, "fused", False)


def test_the_sampler_kernel_is_off_until_asked_for_and_cpu_rows_never_take_it():
    assert sampler._tail[0] is None
    calls = []
    sampler._tail[0] = lambda *a: calls.append(a) or torch.zeros(1, dtype=torch.int64)
    rows = sampler.SamplingRows(
        temperature=torch.ones(1), top_k=torch.zeros(1, dtype=torch.int64), top_p=torch.ones(1),
        min_p=torch.zeros(1), rep_penalty=torch.ones(1), seed=torch.zeros(1, dtype=torch.int64),
        counter=torch.zeros(1, dtype=torch.int64), history=None, block_stop=torch.zeros(1, dtype=torch.bool),
    )  # fmt: skip
    try:
        sampler.sample_rows(torch.randn(1, 8), rows, torch.empty(0, dtype=torch.int64))
    finally:
        sampler._tail[0] = None
    assert calls == []  # a CPU row: the torch tail
    assert sampler.use_tail_kernel(False) is False and sampler._tail[0] is None
