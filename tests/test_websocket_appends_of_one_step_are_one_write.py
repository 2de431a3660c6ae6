"""The gpu_worker writes a request's appended text once per step (gpu_worker/appends.py): the items
of several `Appends` that came between two steps go into its slot as one `extend` of all their ids,
and the frames are those of the whole text, as when each item is written alone."""

from __future__ import annotations

import pytest

from common.config import GpuWorkerSettings
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread
from tests.test_appended_text_waits_out_of_the_batch_and_gives_the_whole_texts_frames import (
    LIMITS,
    TEXT,
    append,
    prompt,
)


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("qwen3-tts-tiny")


def test_the_items_of_one_step_are_one_write_and_give_the_whole_texts_frames(program, monkeypatch):
    ids = program.preprocess(TEXT, {"non_streaming_mode": "false"}).state["text"]
    sp = dict(temperature=0.9, top_k=50, seed=7)
    whole = Engine(program, GpuWorkerSettings(**LIMITS))
    whole.outputs = {}
    whole.add(prompt(program, "r", TEXT, sp))
    whole.run_until_idle()

    writes: list[tuple[int, list[int], int]] = []
    extend = program.extend

    def counted(slot, state, start):
        writes.append((slot, state["text"].tolist(), start))
        extend(slot, state, start)

    monkeypatch.setattr(program, "extend", counted)
    eng = Engine(program, GpuWorkerSettings(**LIMITS))
    eng.outputs = {}
    eng.add(prompt(program, "r", TEXT, sp, n_open=2))
    for _ in range(4):
        eng.step()
    req = eng.running["r"]
    slot = req.slot
    assert eng.scheduler.waits(req) and not eng.has_work()
    for a, b in ((2, 3), (3, 5), (5, 6)):  # three messages before the next step
        eng.append(append("r", ids[a:b]))
    assert eng.has_work()
    eng.step()
    assert writes == [(slot, ids[2:6].tolist(), 2)] and req.n_text == 6
    eng.append(append("r", ids[6:9]))
    eng.append(append("r", ids[9:], end=True))
    eng.run_until_idle()
    assert writes[1:] == [(slot, ids[6:].tolist(), 6)]
    assert eng.outputs == whole.outputs
