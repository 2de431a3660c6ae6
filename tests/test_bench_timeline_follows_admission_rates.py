"""bench/load.py's GaugeSampler: a level's timeline follows the gauges and, sample to sample, the
rate of the counters that show a burst's admission (prompts started, steps, steps stopped for room)."""

from __future__ import annotations

import itertools
import types

import pytest

import bench.load as load
from bench.load import TIMELINE_RATES, GaugeSampler

EVERY = 0.25  # seconds between samples on the sampler's clock
# prompts started in each interval: a burst admitted in a second, then a prompt now and then
PROMPTS = [0, 80, 75, 70, 65, 2, 1, 0, 3]
STEPS = 30  # each interval


def test_the_timeline_gives_each_admission_counters_rate_between_samples(monkeypatch):
    ticks = itertools.count()
    n = [0]  # the sample being taken: the sampler reads its clock, then the gauges

    def clock() -> float:
        n[0] = min(next(ticks), len(PROMPTS) - 1)
        return EVERY * n[0]

    def gauges(base: str) -> dict[str, float]:  # the server's gauges at sample n
        k = n[0]
        return {
            "prompts_started_total": float(sum(PROMPTS[: k + 1])),
            "steps_total": float(STEPS * k),
            "admission_stopped_by_room_total": float(sum(p > 10 for p in PROMPTS[1 : k + 1]) * STEPS),
            "decode_batch_size": 64.0,
            "stream_capacity": 370.0,
        }

    monkeypatch.setattr(load, "server_gauges", gauges)
    monkeypatch.setattr(load, "time", types.SimpleNamespace(monotonic=clock))
    sampler = GaugeSampler("http://server", every=0.01)
    while len(sampler.samples) < len(PROMPTS):
        sampler._stop.wait(0.01)
    sampler._stop.set()
    sampler._thread.join()
    sampler.samples = sampler.samples[: len(PROMPTS)]
    out = sampler.summary()
    timeline = out["timeline"]
    assert timeline["t_s"] == [EVERY * n for n in range(len(PROMPTS))]
    assert timeline["stream_capacity"] == [370.0] * len(PROMPTS)
    assert {k.removesuffix("_total") + "_per_s" for k in TIMELINE_RATES} <= set(timeline)
    assert timeline["prompts_started_per_s"] == [None, *(p / EVERY for p in PROMPTS[1:])]
    assert timeline["steps_per_s"] == [None, *[STEPS / EVERY] * (len(PROMPTS) - 1)]
    assert timeline["admission_stopped_by_room_per_s"] == [
        None,
        *((STEPS / EVERY) * (p > 10) for p in PROMPTS[1:]),
    ]
    span = EVERY * (len(PROMPTS) - 1)
    assert out["prompts_started_per_s"] == pytest.approx(sum(PROMPTS) / span, abs=1e-3)  # over the level
    assert out["prompts_per_step"] == pytest.approx(sum(PROMPTS) / (STEPS * (len(PROMPTS) - 1)), abs=0.01)
