"""Higgs Audio v2 voice cloning on the GPU (dummy weights of the published configs).

1. The clip encoder (HuBERT base + the DAC encoder + the quantizer, fp32) on the GPU against the
   same encoder on the CPU for a 5 s clip (cuDNN's TF32 off: float32 convolutions as such): the
   share of equal codes, and the encoder's time per clip of 5 s and 20 s.
2. A cloned request's greedy rows (3B, bf16, graphs; a 3 s clip's 84 rows in its prompt) alone and
   among 3 and 17 others joining at different steps, some cloned with other clips: equal.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from parity_checks import bf16_engines

from common.messages import Prompt, SamplingParams
from programs.base import Voice
from programs.higgs_tts.encoder import HiggsEncoder

MODEL = "higgs-tts"


def clip(seconds: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(24000 * seconds)) / 24000
    tone = 0.3 * torch.sin(2 * math.pi * 150 * t) * torch.sin(2 * math.pi * 3 * t)
    return (tone + 0.05 * torch.randn(len(t), generator=gen)).float()


def test_the_encoder_on_the_gpu_gives_the_cpus_codes(gpu_report):
    from programs import get_spec, load_program_class

    prog = load_program_class(MODEL)(get_spec(MODEL), load_format="dummy")
    path = prog.config_path("codec_config")
    cpu = HiggsEncoder.from_config(path, torch.float32, "cpu")
    gpu = HiggsEncoder.from_config(path, torch.float32, "cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        x = clip(5.0, 1)
        want = cpu.encode(x)
        got = gpu.encode(x.cuda()).cpu()
        times = {}
        for seconds in (5.0, 20.0):
            y = clip(seconds, 2).cuda()
            gpu.encode(y)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                gpu.encode(y)
            torch.cuda.synchronize()
            times[f"{seconds:.0f} s"] = (time.perf_counter() - t0) / 3 * 1000
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    equal = float((got == want).float().mean())
    report = gpu_report("higgs-tts-clone")
    report["encoder_gpu_vs_cpu_equal_codes"] = equal
    report["encoder_ms_per_clip"] = times
    assert got.shape == (125, 8) and equal >= 0.98


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_cloned_greedy_rows_alone_equal_those_among_others(quantization, gpu_report):
    """A cloned request (75 clip frames in its prompt) alone and among 3 and 17 others, some cloned,
    joining at other steps. With float8 projections (`--quantization fp8`, row-invariant GEMMs)
    its rows are the same among both; with bf16 weights among 3, and among 17 reported only (a
    bf16 GEMM rounds a row by the step's row count: docs/performance.md, "Batch invariance")."""
    prog, eng, _ = bf16_engines(MODEL, quantization)
    prog.load_prompts()
    rng = np.random.default_rng(0)

    def prompt(rid: str, text: str, frames: int, new: int = 60) -> Prompt:
        voice = Voice({"codes": rng.integers(0, 1024, (frames, 8)).astype(np.int32)}, "A reference.")
        rows = prog.preprocess(text, {}, voice if frames else None).rows.astype("<i4")
        sp = SamplingParams(temperature=0.0, max_tokens=len(rows) + new)
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    def generate(order: list[Prompt]) -> list:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        return eng.outputs["x"][0]

    x = prompt("x", "The same words, spoken again and again.", 75)
    alone = generate([x])
    first_diff = {}
    for n_others in (3, 17):
        others = [
            prompt(f"o{i}", "other text " * (1 + i % 5), 25 * (i % 3), 40 + 3 * i) for i in range(n_others)
        ]
        got = generate([*others[: n_others // 2], x, *others[n_others // 2 :]])
        first_diff[n_others] = next(
            (i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None
        )
    gpu_report("higgs-tts-clone").setdefault("cloned_greedy_alone_vs_batched_first_difference", {})[
        quantization
    ] = first_diff
    checked = first_diff if quantization == "fp8" else {3: first_diff[3]}
    assert checked == dict.fromkeys(checked, None), first_diff
