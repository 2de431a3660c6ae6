"""Native input streaming in the gpu_worker's engine (gpu_worker/appends.py) on qwen3-tts-tiny in its
streaming text mode: a request opened with the first text ids and given the rest as appends
generates the frames of the same text sent whole (greedy and sampled, beside another stream);
while its text runs out it sits out of every step (no frames, no work for the worker) and resumes
when text comes; text past the slot's capacity, an append after the end and an append to an
unknown request end cleanly, every slot and page given back. The tokenizer's split
(`take_text`) keeps the ids of any text cut anywhere equal to those of the whole."""

from __future__ import annotations

import random

import numpy as np
import pytest

from common.arrays import wire_array
from common.config import GpuWorkerSettings
from common.messages import Append, Appends, FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from tests.conftest import tiny_lm_on_one_thread

LIMITS = dict(max_batch_size=4, max_context=200)
TEXT = "Hello there, how are you today? I think we should call them first."
GEN = 30  # frames each request generates (min_tokens keeps the random model from stopping early)


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("qwen3-tts-tiny")


def prompt(program, rid: str, text: str, sp: dict, n_open: int | None = None) -> Prompt:
    """The streaming text mode's prompt of `text`; with `n_open`, opened with its first n_open ids
    only (the rest to be appended)."""
    built = program.preprocess(text, {"non_streaming_mode": "false", "voice": "ryan"})
    rows = built.rows.astype("<i4")
    ids = built.state["text"]
    state = {"text": wire_array(ids if n_open is None else ids[:n_open])}
    sampling = SamplingParams(max_tokens=len(rows) + GEN, min_tokens=GEN, **sp)
    return Prompt(rid, rows.tobytes(), len(rows), sampling, state=state, open_input=n_open is not None)


def append(rid: str, ids: np.ndarray, end: bool = False) -> Appends:
    return Appends([Append(rid, {"text": wire_array(ids)}, len(ids), end)])


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=0.9, top_k=50, seed=11)])
def test_appended_text_gives_the_frames_of_the_whole_text(program, sp):
    ids = program.preprocess(TEXT, {"non_streaming_mode": "false"}).state["text"]
    other = dict(temperature=0.8, seed=3)
    whole = Engine(program, GpuWorkerSettings(**LIMITS))
    whole.outputs = {}
    whole.add(prompt(program, "r", TEXT, sp))
    whole.add(prompt(program, "other", "Yes, that is right.", other))
    whole.run_until_idle()

    eng = Engine(program, GpuWorkerSettings(**LIMITS))
    eng.outputs = {}
    eng.add(prompt(program, "r", TEXT, sp, n_open=2))
    eng.add(prompt(program, "other", "Yes, that is right.", other))
    for _ in range(6):
        eng.step()
    req = eng.running["r"]
    assert req.n_launched == 2 and eng.scheduler.waits(req)  # the prompt, then frame 0 with id 1
    stepped = eng.running["other"].n_launched
    for _ in range(3):
        eng.step()
    assert req.n_launched == 2 and eng.running["other"].n_launched == stepped + 3  # it sits out alone
    eng.append(append("r", ids[2:5]))
    for _ in range(GEN + 5):  # the other stream runs to its end meanwhile
        if not eng.has_work():
            break
        eng.step()
    assert req.n_launched == 5 and eng.scheduler.waits(req)
    assert "other" not in eng.running and not eng.has_work()  # nothing to do but wait for text
    eng.append(append("r", ids[5:], end=True))
    assert eng.has_work()
    eng.run_until_idle()
    assert eng.outputs == whole.outputs
    frames, reason = eng.outputs["r"]
    assert len(frames) == GEN > len(ids) and reason == FinishReason.LENGTH
    assert eng.allocator.num_used == 0 and eng.slots.num_free == LIMITS["max_batch_size"]


def test_text_appended_before_admission_joins_the_prompts_state(program):
    ids = program.preprocess(TEXT, {"non_streaming_mode": "false"}).state["text"]
    sp = dict(temperature=0.0)
    whole = Engine(program, GpuWorkerSettings(**LIMITS))
    whole.outputs = {}
    whole.add(prompt(program, "r", TEXT, sp))
    whole.run_until_idle()
    eng = Engine(program, GpuWorkerSettings(**LIMITS))
    eng.outputs = {}
    eng.add(prompt(program, "r", TEXT, sp, n_open=1))
    eng.append(append("r", ids[1:4]))  # still waiting for its slot
    eng.append(append("r", ids[4:], end=True))
    eng.run_until_idle()
    assert eng.outputs == whole.outputs


def _ended(eng: Engine, rid: str):
    for _ in range(4):
        batch = eng.step()
        for fin in batch.finished if batch is not None else []:
            if fin.rid == rid:
                return fin
    raise AssertionError(f"{rid} did not end")


def test_text_past_capacity_or_after_the_end_ends_the_request_with_a_400(program):
    eng = Engine(program, GpuWorkerSettings(**LIMITS))
    eng.add(prompt(program, "big", TEXT, {}, n_open=2))
    eng.step()
    too_many = np.ones(program.append_capacity, dtype=np.int32)
    eng.append(append("big", too_many))
    fin = _ended(eng, "big")
    assert (
        fin.reason == FinishReason.ERROR and fin.status == 400 and "more than one generation" in fin.message
    )
    eng.add(prompt(program, "late", TEXT, {}, n_open=2))
    eng.step()
    eng.append(append("late", np.ones(2, np.int32), end=True))
    eng.append(append("late", np.ones(2, np.int32)))
    fin = _ended(eng, "late")
    assert fin.status == 400 and "after the request's input ended" in fin.message
    eng.append(append("nobody", np.ones(2, np.int32)))  # not held here: dropped
    bad = Appends([Append("x", {"text": wire_array(np.array([program.text_vocab_size]))}, 1)])
    eng.add(prompt(program, "x", TEXT, {}, n_open=2))
    eng.append(bad)
    fin = _ended(eng, "x")
    assert fin.status == 400 and "bad append" in fin.message
    while eng.has_work():
        eng.step()
    assert eng.allocator.num_used == 0 and eng.slots.num_free == LIMITS["max_batch_size"]


def test_a_lane_request_avoids_a_slot_whose_appended_text_the_step_in_flight_may_still_write(
    program, monkeypatch
):
    """Text appended to a request that then sits the step out is written into its slot ahead of
    that step, on the steps' stream; if the request ends while the step runs, a prompt lane (a
    stream of its own) must not take its slot or pages until the step has ended."""
    ids = program.preprocess(TEXT, {"non_streaming_mode": "false"}).state["text"]
    eng = Engine(program, GpuWorkerSettings(**LIMITS, prompt_lane="on"))
    eng.outputs = {}
    eng.add(prompt(program, "r", TEXT, dict(temperature=0.0), n_open=2))
    eng.add(prompt(program, "other", "Yes, that is right.", dict(temperature=0.8, seed=3)))
    for _ in range(6):
        eng.step()
    req = eng.running["r"]
    assert eng.scheduler.waits(req)
    eng.append(append("r", ids[2:5]))
    waits = eng.scheduler.waits
    monkeypatch.setattr(eng.scheduler, "waits", lambda q: q is req or waits(q))  # it sits out anyway
    eng.step()  # writes its text into its slot, then launches a step without it
    step = eng._inflight
    assert req not in step.batch and step.touched == [req]
    eng.abort("r")
    slot, pages = req.released
    assert slot == eng.slots._free[-1]  # free, and next in line
    avoid_slots, avoid_pages = eng._lane_avoids(step)
    assert slot in avoid_slots and set(pages) <= avoid_pages
    eng.add(prompt(program, "new", "A new one.", dict(temperature=0.0)))
    eng.lane_step()
    new = eng.running["new"]
    assert new.lane and new.slot != slot and not set(new.pages) & set(pages)
    monkeypatch.setattr(eng.scheduler, "waits", waits)
    while eng.has_work():  # the worker's turns: a step, then the lanes'
        eng.step()
        eng.lane_step()
    assert eng.outputs["r"][1] == FinishReason.ABORT and "new" in eng.outputs
    assert eng.allocator.num_used == 0 and eng.slots.num_free == LIMITS["max_batch_size"]


def test_text_cut_anywhere_keeps_the_ids_of_the_whole(program):
    rng = random.Random(0)
    texts = [TEXT, "Well,  honestly\n\nI don't know... 3.5 km!", "Ünïcode wörds, and  spaces  "]
    for text in texts:
        whole = program.text_ids(text)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), 4))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            ids, held = [], ""
            for i, piece in enumerate(pieces):
                taken, held = program.take_text(held + piece, final=i == len(pieces) - 1)
                ids += program.append(taken)["text"].tolist()
            assert held == "" and ids == whole, pieces
