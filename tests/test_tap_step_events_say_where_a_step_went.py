"""While a tap listens, the gpu_worker publishes one `step` event a step: the batch it launched, the
prompts it started, and where its wall time went (schedule, launch, wait, process: they add up to
the engine's call); `voxpipe bench tap-stats` sums the steps up, those that start prompts apart
from those that do not and from those after which prompts still wait (a burst's admission)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.tap_stats import stats
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker import stages
from gpu_worker.engine import Engine
from gpu_worker.stages import StageReporter
from tests.conftest import tiny_lm_on_one_thread


@pytest.fixture(scope="module")
def program():
    yield from tiny_lm_on_one_thread("orpheus-tiny")


def prompt(rid: str) -> Prompt:
    rows = np.array([128259, 128000, 40, 41, 42, 128009, 128260, 128261, 128257], dtype="<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=40, seed=1, constrained=True))


def test_each_step_publishes_its_batch_prompts_and_parts(program, monkeypatch):
    published = []
    monkeypatch.setattr(stages, "tap_listening", lambda: True)
    monkeypatch.setattr(
        stages, "publish_stage", lambda rid, stage, t=None, **d: published.append((rid, stage, d))
    )
    # one prompt a step at most: the rest wait, as in a burst's admission
    eng = Engine(program, GpuWorkerSettings(max_batch_size=8, max_context=200, max_prefills=1))
    reporter = StageReporter()
    reporter.publish(eng)  # a listener arrives: nothing before it is reported
    assert published == []
    for i in range(3):
        eng.add(prompt(f"r{i}"))
    for _ in range(6):
        eng.step()
        reporter.publish(eng)
    steps = [d for rid, stage, d in published if stage == "step"]
    assert all(rid == "" for rid, stage, _ in published if stage == "step")
    assert [d["step"] for d in steps] == list(range(6))  # steps collected before this one's results
    assert [d["prompts"] for d in steps[:3]] == [1, 1, 1] and steps[3]["prompts"] == 0
    assert [d["waiting"] for d in steps[:3]] == [2, 1, 0]
    assert [d["stop"] for d in steps[:3]] == ["cap", "cap", ""]  # what left prompts waiting
    assert all(d["withheld_ms"] == 0.0 for d in steps)  # on a CPU nothing is paced
    assert [d["running"] for d in steps] == [1, 2, 3, 3, 3, 3]
    assert all(d["batch"] >= d["prompts"] for d in steps) and steps[2]["batch"] == 3
    for d in steps:
        parts = d["schedule_ms"] + d["launch_ms"] + d["wait_ms"] + d["process_ms"]
        assert parts == pytest.approx(d["wall_ms"], abs=0.01)
        assert d["wall_ms"] > 0 and d["loop_ms"] >= d["wall_ms"] - 0.01 and d["gpu_ms"] == 0.0
    admitted = [rid for rid, stage, _ in published if stage == "admitted"]
    assert admitted == ["r0", "r1", "r2"]


def step(
    i: int, batch: int, prompts: int, waiting: int, loop: float, gpu: float, withheld: float = 0.0
) -> dict:
    parts = {"wall_ms": loop - 1, "gpu_ms": gpu, "schedule_ms": 1.0, "launch_ms": 2.0, "wait_ms": 3.0}
    stop = "" if not waiting else "room" if withheld else "cap"
    return {"stage": "step", "rid": "", "time": 100.0 + i / 100, "step": i, "batch": batch, "prompts": prompts,
            "waiting": waiting, "running": batch, "loop_ms": loop, "process_ms": loop - 7, "stop": stop,
            "withheld_ms": withheld, **parts}  # fmt: skip


def test_tap_stats_sums_up_the_steps_by_kind():
    events = [step(i, 20 * (i + 1), 20, 100 - 20 * i, 30.0, 18.0, 2.0 * (i < 2)) for i in range(5)]  # a burst
    events += [step(5, 100, 0, 0, 10.0, 9.0), step(6, 100, 0, 0, 12.0, 9.0), step(7, 101, 1, 0, 11.0, 9.5)]
    events += [step(8, 0, 0, 0, 5.0, 9.0)]  # collected only: not a launched step
    events += [{"stage": "received", "rid": "a", "time": 99.0}]
    out = stats(events)
    assert out["requests_seen"] == 1  # step events are no request's
    s = out["steps"]
    assert s["launched"] == 8
    assert s["with_prompts"]["n"] == 6 and s["with_prompts"]["prompts_max"] == 20
    assert s["decode_only"]["n"] == 2 and s["decode_only"]["loop_ms"]["mean"] == 11.0
    waiting = s["prompts_waiting"]
    assert waiting["n"] == 5 and waiting["prompts_mean"] == 20.0 and waiting["batch_mean"] == 60.0
    assert waiting["loop_ms"]["p50"] == 30.0 and waiting["gpu_ms"]["mean"] == 18.0
    assert waiting["process_ms"]["max"] == 23.0
    # two steps held to what the playing streams spared, three by the cap
    assert waiting["stops"] == {"room": 2, "cap": 3} and waiting["withheld_ms"]["max"] == 2.0
