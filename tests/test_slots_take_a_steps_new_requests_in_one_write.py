"""A step's new requests write their sampling settings into their slots together (one copy per
tensor, `SlotState.write`): each slot ends up as it would with a write of its own."""

from __future__ import annotations

import numpy as np
import torch

from common.messages import SamplingParams
from gpu_worker.runner.slots import SlotState

REQUESTS = [
    (SamplingParams(temperature=0.6, top_p=0.8, seed=3), np.array([5, 6, 7]), True, np.array([7, 1])),
    (SamplingParams(top_k=40, repetition_penalty=1.3, repetition_window=8), np.array([9]), True, None),
    (
        SamplingParams(min_p=0.1, min_tokens=4, repetition_penalty=2.0),
        np.array([2, 3]),
        False,
        np.array([3, 4]),
    ),
]


def state() -> SlotState:
    s = SlotState(6, 16, 2, torch.device("cpu"))
    # used before: a previous request's history, last row and audio count in every slot
    s.history.fill_(77)
    s.last.fill_(88)
    s.n_audio.fill_(9)
    return s


def test_one_write_for_several_requests_equals_a_write_each():
    together, alone = state(), state()
    slots = [together.claim() for _ in REQUESTS]
    together.write(slots, REQUESTS)
    for slot, req in zip(slots, REQUESTS, strict=True):
        assert alone.claim() == slot
        alone.write([slot], [req])
    for name in ("floats", "ints", "history", "last", "n_audio"):
        assert torch.equal(getattr(together, name), getattr(alone, name)), name
    s = together
    assert s.history[slots[0], :5].tolist() == [5, 6, 7, 5, 5]  # past the prompt: its first id
    assert s.last[slots[0]].tolist() == [7, 1] and s.last[slots[1]].tolist() == [88, 88]  # no last row
    assert s.history[slots[2], :3].tolist() == [0, 0, 0] and s.penalty[slots[2]] == 1.0  # no penalty
    assert s.penalty[slots[1]] == 1.3 and s.window[slots[1]] == 8 and s.top_k[slots[1]] == 40
    assert (
        s.n_audio[slots].tolist() == [0, 0, 0] and s.n_audio.sum() == 9 * 4
    )  # the other 3 and the scratch slot untouched
    assert s.num_free == 3


def test_admit_claims_then_writes_and_avoids_slots():
    s = state()
    assert s.admit(*REQUESTS[0][:2], avoid={0}) == 1
    assert s.admit(*REQUESTS[1][:2]) == 0
    assert s.history[1, :3].tolist() == [5, 6, 7] and s.temperature[1] == np.float32(0.6)
    s.write([], [])  # nothing to write: no copy at all
