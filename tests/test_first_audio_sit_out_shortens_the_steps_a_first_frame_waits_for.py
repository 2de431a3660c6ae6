"""`--first-audio-sit-out` (progressive first chunks): while a running stream waits for its first
chunk or still sends tail windows, the streams most ahead (with --sit-out's audio in hand) sit out
until a step, by the fitted cost, comes to the pace that sends a first frame alone; never more than
half the streams, never while the steps' mean interval is past that pace, and not at all without a
young stream. It is the policy bench/admission_sim.py weighs (`--first-audio-sit-out`), one class."""

from __future__ import annotations

import numpy as np
import pytest

from bench import admission_sim
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.scheduler.sit_out import FirstAudioSitOut
from programs import get_spec, load_program_class

ROWS = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")
N = 20


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", lm_head="audio")
    p.load_lm()
    return p


def engine(
    program, interval_s: float = 0.005, young: bool = True, codec_lane: bool = False, **limits
) -> tuple[Engine, list]:
    """N streams running, a step cost fitted as 3.9 ms + 0.2 ms a row, steps every `interval_s`; every
    stream playing with 1 s of audio in hand or more (the later, the more), its tail windows over,
    but the first (with `young`), which still sends tail windows."""
    settings = {"max_batch_size": 32, "max_context": 64, "first_chunk": "progressive", **limits}
    eng = Engine(program, GpuWorkerSettings(**settings), codec_lane=codec_lane)
    sampling = SamplingParams(max_tokens=len(ROWS) + 40, temperature=0.0)
    for i in range(N):
        eng.add(Prompt(rid=f"r{i}", tokens=ROWS.tobytes(), n_rows=len(ROWS), sampling=sampling))
    eng.step()
    s = eng.scheduler
    assert len(s.running) == N
    s.real_time = True  # paced as on a GPU
    rng = np.random.default_rng(0)
    for _ in range(400):
        rows = int(rng.integers(1, 300))
        s.clock.cost.add(rows, int(rng.integers(0, 50_000)), 0, 0.0039 + 0.0002 * rows)
    for _ in range(120):
        s.clock.record(N, interval_s)
    now, reqs = eng.windows.now(), list(s.running.values())
    for k, r in enumerate(reqs):
        r.n_chunks, r.switched, r.t_first, r.sent_s = 3, True, now, 1.0 + 0.01 * k
    if young:
        reqs[0].switched, reqs[0].sent_s = False, 0.085
    return eng, reqs


def left_out(eng: Engine, reqs: list) -> list[str]:
    kept = {r.rid for r in eng.scheduler.leave_out_streams_ahead(reqs, 0)}
    return [r.rid for r in reqs if r.rid not in kept]


def test_the_streams_most_ahead_sit_out_until_the_step_comes_to_the_one_frame_pace(program):
    eng, reqs = engine(program, first_audio_sit_out=True)
    bound = eng.windows.one_frame_row_s()  # 7.5 ms: (85.3 ms of a frame - 25 ms) / (7 x 1.15)
    assert bound == pytest.approx(admission_sim.one_frame_s(), rel=1e-3)  # the simulation's, for Orpheus
    # 3.9 + 0.2 x rows ms within 7.49 / 1.1 ms: 14 rows, so the six most ahead sit out
    assert left_out(eng, reqs) == [f"r{i}" for i in range(14, N)]


def test_with_the_codec_lane_the_pace_follows_the_second_chunks_allowance_at_the_load_of_the_moment(program):
    eng, reqs = engine(program, first_audio_sit_out=True, codec_lane=True)
    s = eng.scheduler
    # 20 streams of the 32 the worker reports: past LANE_ROOM, the second chunk's trip is allowed
    # 25 ms and the pace is the default's (six sit out, as above)
    assert eng.windows.second_trip_s() == pytest.approx(0.025)
    assert eng.windows.one_frame_row_s() == pytest.approx(admission_sim.one_frame_s(), rel=1e-3)
    assert left_out(eng, reqs) == [f"r{i}" for i in range(14, N)]
    # of 64: within it, 15 ms, a pace of 8.7 ms a row (7.9 ms a step by the margin): 19 rows, so
    # only the stream most ahead sits out
    s.last_capacity = 64.0
    assert eng.windows.one_frame_row_s() == pytest.approx(
        admission_sim.one_frame_s(delivery_s=0.015), rel=1e-3
    )
    assert left_out(eng, reqs) == [f"r{N - 1}"]


@pytest.mark.parametrize(
    "why, kw",
    [
        ("off", dict(first_audio_sit_out=False)),
        ("no stream waits for its first frames", dict(first_audio_sit_out=True, young=False)),
        ("the steps' interval is past the one-frame pace", dict(first_audio_sit_out=True, interval_s=0.009)),
    ],
)
def test_no_stream_sits_out_for_first_audio_when(program, why, kw):
    eng, reqs = engine(program, **kw)
    assert left_out(eng, reqs) == [], why


def test_never_more_than_half_the_streams(program):
    eng, reqs = engine(program, first_audio_sit_out=True)
    fast = FirstAudioSitOut(eng.scheduler.clock, None, 0.5, bound=0.0050)  # 4.5 ms: 3 rows
    eng.scheduler.first_audio = fast
    assert left_out(eng, reqs) == [f"r{i}" for i in range(N // 2, N)]


def test_it_needs_progressive_first_chunks(program):
    with pytest.raises(ValueError, match="progressive"):
        GpuWorkerSettings(first_audio_sit_out=True, first_chunk="adaptive").check()
    with pytest.raises(ValueError, match="progressive"):
        engine(program, first_audio_sit_out=True, first_chunk="adaptive")
