"""A program that holds its first audible windows (`detok_first_windows` > 1) sends them together
once the last exists. The runtime refuses the settings where that could wait forever or has no
meaning: a request taking appended text may sit out waiting for text with windows held (a client
waiting for audio before it sends more would never get it), and progressive first chunks send
frames one by one; and at least one window starts the listener's clock."""

from __future__ import annotations

import pytest

from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.windows import AudioWindows
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def qwen():
    return load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")


@pytest.fixture(scope="module")
def orpheus():
    return load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")


def clock(p) -> StepClock:
    return StepClock(p.rows_per_second, 8)


def test_a_program_taking_appended_text_holds_no_first_windows(qwen, monkeypatch) -> None:
    assert qwen.appends_text
    AudioWindows(qwen, "adaptive", clock(qwen))  # one window: fine
    monkeypatch.setattr(qwen, "detok_first_windows", 3)
    with pytest.raises(ValueError, match="appended text"):
        AudioWindows(qwen, "adaptive", clock(qwen))


def test_progressive_first_chunks_hold_no_first_windows(orpheus, monkeypatch) -> None:
    AudioWindows(orpheus, "progressive", clock(orpheus))
    monkeypatch.setattr(orpheus, "detok_first_windows", 2)
    with pytest.raises(ValueError, match="progressive"):
        AudioWindows(orpheus, "progressive", clock(orpheus))
    AudioWindows(orpheus, "adaptive", clock(orpheus))  # held windows with lead windows: fine


def test_at_least_one_window_starts_the_clock(orpheus, monkeypatch) -> None:
    monkeypatch.setattr(orpheus, "detok_first_windows", 0)
    with pytest.raises(ValueError, match="at least 1"):
        AudioWindows(orpheus, "adaptive", clock(orpheus))
