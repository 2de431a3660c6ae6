"""Qwen3-TTS's appended text on the GPU (dummy 1.7B CustomVoice weights, bf16, CUDA graphs): a request
opened with its first text ids and given the rest as appends, waiting out of the batch while its
text runs out, generates the frames of the same text sent whole in the streaming text mode: alone
(greedy and sampled) and beside other streams (greedy; as the batch-invariance checks, the frames
of a request do not depend on its batch). The appends are written into the slot between steps
while the graphs read the text buffer in place."""

from __future__ import annotations

import pytest
import torch

from common.config import GpuWorkerSettings
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from tests.test_appended_text_waits_out_of_the_batch_and_gives_the_whole_texts_frames import (
    TEXT,
    append,
    prompt,
)

MODEL = "qwen3-tts"
LIMITS = dict(max_batch_size=8, max_context=512)


@pytest.fixture(scope="module")
def program():
    prog = load_program_class(MODEL)(
        get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16
    )
    prog.load_lm()
    return prog


def _run(eng: Engine, program, sp: dict, n_others: int, appended: bool) -> dict:
    ids = program.preprocess(TEXT, {"non_streaming_mode": "false"}).state["text"]
    eng.outputs = {}
    eng.add(prompt(program, "r", TEXT, sp, n_open=3 if appended else None))
    for i in range(n_others):
        eng.add(prompt(program, f"o{i}", "Yes, that is right.", dict(temperature=0.0)))
    if appended:
        for lo, hi in ((3, 6), (6, 9)):
            for _ in range(6):  # it waits out of the batch for a few steps each time
                eng.step()
            eng.append(append("r", ids[lo:hi]))
        for _ in range(6):
            eng.step()
        eng.append(append("r", ids[9:], end=True))
    eng.run_until_idle()
    return eng.outputs


@pytest.mark.parametrize(
    ("sp", "n_others"),
    [(dict(temperature=0.0), 0), (dict(temperature=0.9, top_k=50, seed=4), 0), (dict(temperature=0.0), 3)],
)
def test_appended_text_gives_the_whole_texts_frames_on_the_gpu(program, sp, n_others):
    eng = Engine(program, GpuWorkerSettings(**LIMITS))
    whole = _run(eng, program, sp, n_others, appended=False)
    assert _run(eng, program, sp, n_others, appended=True) == whole
    assert eng.allocator.num_used == 0 and eng.slots.num_free == LIMITS["max_batch_size"]
