"""The pinned ring (common/pinned.py): spans handed out round-robin, aligned, never overlapping a
span whose copies (its fence's event) may still run: such a span is waited for; spans whose
events have passed are reused without a wait; a tensor larger than the ring gets memory of its own.
On a CPU the ring is pageable memory and the events are the test's (the device's stream order is
what a CUDA event reports)."""

from __future__ import annotations

import torch

from common.pinned import ALIGN, PinnedRing


class Event:
    """A stream event the test completes by hand: `query` says whether it has passed; a
    `synchronize` on one that has not counts as a wait, and passes it."""

    made: list[Event] = []

    def __init__(self) -> None:
        self.done = False
        self.recorded = False
        self.synced = 0
        Event.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


def spans(ring: PinnedRing, *tensors: torch.Tensor) -> list[int]:
    """Byte offsets in the ring of each staged tensor."""
    base = ring.buf.data_ptr()
    return [ring.stage(t).data_ptr() - base for t in tensors]


def test_spans_go_round_and_wait_only_for_copies_still_running():
    Event.made.clear()
    ring = PinnedRing(4 * ALIGN, pinned=False, event=Event)
    a, b = torch.arange(10, dtype=torch.int64), torch.ones(3, 4)
    staged = ring.stage(a)
    assert torch.equal(staged, a) and staged.dtype == a.dtype and staged.shape == a.shape
    assert spans(ring, b) == [ALIGN]  # aligned, one after the other
    ring.fence()
    first = Event.made[-1]
    assert first.recorded and len(Event.made) == 1  # one event for the spans since the last fence
    assert spans(ring, torch.zeros(ALIGN // 4, dtype=torch.int32)) == [2 * ALIGN]
    ring.fence()
    second = Event.made[-1]
    # 2 spans do not fit after 3: round to 0, which the first fence's copies may still read
    assert spans(ring, torch.zeros(2 * ALIGN, dtype=torch.uint8)) == [0]
    assert first.synced == 1 and ring.waits == 1 and second.synced == 0
    ring.fence()
    third = Event.made[-1]
    second.done = third.done = True  # their copies ran
    assert spans(ring, torch.zeros(3 * ALIGN, dtype=torch.uint8)) == [0]  # round again, no wait
    assert ring.waits == 1 and second.synced == third.synced == 0
    big = torch.arange(5 * ALIGN, dtype=torch.uint8)
    own = ring.stage(big)  # larger than the ring: memory of its own
    assert torch.equal(own, big) and not (0 <= own.data_ptr() - ring.buf.data_ptr() < ring.buf.numel())


def test_an_empty_tensor_and_every_dtype_keep_their_values():
    ring = PinnedRing(64 * ALIGN, pinned=False, event=Event)
    for t in (torch.zeros(0, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([True, False]),
              torch.arange(12, dtype=torch.int32).view(3, 4).t()):  # fmt: skip
        staged = ring.stage(t)
        assert staged.shape == t.shape and staged.dtype == t.dtype and torch.equal(staged, t)
        ring.fence()
    out = ring.take((2, 5), torch.int64)
    assert (
        out.shape == (2, 5)
        and out.dtype == torch.int64
        and (out.data_ptr() - ring.buf.data_ptr()) % ALIGN == 0
    )


def test_a_span_staged_twice_before_its_fence_is_refused():
    ring = PinnedRing(2 * ALIGN, pinned=False, event=Event)
    ring.stage(torch.zeros(ALIGN, dtype=torch.uint8))
    ring.stage(torch.zeros(ALIGN, dtype=torch.uint8))
    try:
        ring.stage(torch.zeros(ALIGN, dtype=torch.uint8))  # would overwrite the first, unfenced
    except RuntimeError as e:
        assert "went round" in str(e)
    else:
        raise AssertionError("an unfenced span was handed out again")
