"""A request's repetition window: the penalty sees only its last `repetition_window` tokens (prompt
included); positions outside are replaced by the newest token, so they penalize nothing new."""

from __future__ import annotations

import numpy as np
import torch

from common.messages import SamplingParams
from gpu_worker.runner.sampler import apply_repetition_penalty
from gpu_worker.runner.slots import SlotState


def test_the_penalty_history_holds_only_the_window():
    slots = SlotState(num_slots=2, max_context=16, n_codebooks=1, device=torch.device("cpu"))
    windowed = slots.admit(
        SamplingParams(repetition_penalty=2.0, repetition_window=3), np.array([5, 6, 7, 8])
    )
    whole = slots.admit(SamplingParams(repetition_penalty=2.0, repetition_window=-1), np.array([5, 6, 7, 8]))
    ids = torch.tensor([windowed, whole])
    length = torch.tensor([4, 4])
    rows = slots.rows(ids, torch.zeros(2, dtype=torch.int64), length, None, windowed=True)
    assert set(rows.history[0].tolist()) == {6, 7, 8}  # the last three of the prompt
    assert set(rows.history[1].tolist()) == {5, 6, 7, 8}
    logits = torch.ones(2, 10)
    apply_repetition_penalty(logits, rows.history, rows.rep_penalty)
    assert logits[0].tolist() == [1, 1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 1]
    assert logits[1].tolist() == [1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 1]
    # No window in the group: the mask is skipped, and the whole-context row is unchanged.
    plain = slots.rows(ids[1:], torch.zeros(1, dtype=torch.int64), length[1:], None, windowed=False)
    assert torch.equal(plain.history, rows.history[1:])
    # No penalty in the group: no history at all.
    assert slots.rows(ids, torch.zeros(2, dtype=torch.int64), length, None, penalize=False).history is None
