"""`lm_head="audio"` computes logits only for codec tokens and stop; constrained requests (which
may only take those tokens anyway) sample exactly what they sample with the full head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.orpheus.spec import AUDIO_BASE, STOP_TOKEN

PROMPT = [128259, 300, 301, 302, 128009, 128260, 128261, 128257]


def program(lm_head: str):
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", lm_head=lm_head)
    p.load_lm()
    return p


def run(p, params: list[SamplingParams]) -> dict:
    eng = Engine(p, GpuWorkerSettings(max_batch_size=4, max_context=200, first_chunk="reference"))
    eng.outputs = {}
    rows = np.array(PROMPT, dtype="<i4")
    for i, sp in enumerate(params):
        eng.add(Prompt(f"r{i}", rows.tobytes(), len(rows), sp))
    eng.run_until_idle()
    return eng.outputs


@pytest.fixture(scope="module")
def programs():
    return program("full"), program("audio")


def test_audio_head_logits_are_the_full_heads_audio_columns(programs):
    full, audio = programs
    hidden = torch.randn(3, full.hidden_size)
    assert audio.head_ids.tolist()[-1] == STOP_TOKEN and audio.head_ids[0] == AUDIO_BASE
    torch.testing.assert_close(
        audio.head(hidden), full.head(hidden)[:, :, audio.head_ids], rtol=1e-5, atol=1e-5
    )


def test_constrained_requests_sample_the_same_tokens_with_either_head(programs):
    full, audio = programs
    params = [
        SamplingParams(max_tokens=70, constrained=True, temperature=0.0, repetition_penalty=1.3, seed=1),
        SamplingParams(max_tokens=70, constrained=True, temperature=0.8, top_p=0.9, seed=2),
        SamplingParams(max_tokens=70, constrained=True, temperature=1.0, top_k=50, min_tokens=30, seed=3),
    ]
    assert run(full, params) == run(audio, params)


def test_unconstrained_requests_with_the_audio_head_only_sample_audio_or_stop(programs):
    _, audio = programs
    out = run(audio, [SamplingParams(max_tokens=80, temperature=1.0, seed=s) for s in range(3)])
    for tokens, _ in out.values():
        assert tokens and all(AUDIO_BASE <= t < AUDIO_BASE + 7 * 4096 for t in tokens)


def test_requests_without_a_penalty_sample_the_same_with_either_head(programs):
    full, audio = programs
    params = [SamplingParams(max_tokens=60, constrained=True, temperature=0.9, repetition_penalty=1.0, seed=s)
              for s in range(2)]  # fmt: skip
    assert run(full, params) == run(audio, params)
