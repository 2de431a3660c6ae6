"""`--first-chunk progressive`: a request's first chunk goes out after one frame when the next frame
will arrive before it has played out (else after two or three, decoded whole), its next frames one
by one as tail windows (the newest frame, decoded after up to three frames of context), until the
audio already sent covers the wait for the next regular window, its steps at the step budget or
the pessimistic pace, whichever is slower; after that, the reference's windows, unchanged."""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest
import soundfile as sf
import torch

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import LEAD_NOISE_BASE, DetokChunk, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.blocks import rng
from tests.conftest import Server

PROMPT = [128259, 300, 301, 302, 128009, 128260, 128261, 128257]
FRAME_S = 2048 / 24000


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    p.load_codec()
    return p


def chunks_of(
    program,
    first_chunk: str,
    step_s: float,
    margin: float = 1.15,
    codec_lane: bool = False,
    load=None,
    **engine,
) -> list[DetokChunk]:
    settings = GpuWorkerSettings(
        max_batch_size=4, max_context=200, first_chunk=first_chunk, first_chunk_margin=margin
    )
    eng = Engine(program, settings, codec_lane=codec_lane, **engine)
    if load is not None:  # the streams running over the capacity, as the scheduler reports them
        eng.windows.load = lambda: load
    for _ in range(10):
        eng.clock.record(1, step_s)  # the pace the engine believes it steps at
    # Keep it there, and let the listener's clock run at that pace (the CPU's real pace would vary).
    now = [0.0]
    eng.clock.tick = lambda batch, streams=0, cost=None: now.__setitem__(0, now[0] + step_s)
    eng.windows.now = lambda: now[0]
    rows = np.array(PROMPT, dtype="<i4")
    sp = SamplingParams(max_tokens=150, min_tokens=130, constrained=True, seed=3)
    eng.add(Prompt("r", rows.tobytes(), len(rows), sp))
    return [c for batch in eng.run_until_idle() for c in batch.chunks]


@pytest.mark.parametrize("margin, first_rows", [(1.15, 14), (1.0, 7)])
def test_a_lower_first_chunk_margin_sends_one_frame_where_the_default_waits_for_two(
    program, margin, first_rows
):
    # 8 ms steps: 7 of them at 1.15 plus DELIVERY_S is 89 ms, past a frame's 85 ms (two frames);
    # at 1.0, 81 ms (one). The audio after the first chunk is the reference's either way.
    got = chunks_of(program, "progressive", 0.008, margin)
    assert (len(got[0].tokens) // 4, got[0].tail_rows) == (first_rows, first_rows)
    ref = chunks_of(program, "reference", 0.008)
    windows = [np.frombuffer(c.tokens, "<i4") for c in ref]  # window j: rows [7j, 7j + 28)
    full = np.concatenate([windows[0], *(w[-7:] for w in windows[1:])])  # the audio rows
    assert np.frombuffer(got[0].tokens, "<i4").tolist() == full[:first_rows].tolist()
    late = [(c.tokens, c.noise_id) for c in got if not c.tail_rows]  # the reference's, at the end
    assert late == [(c.tokens, c.noise_id) for c in ref[len(ref) - len(late) :]]


def test_with_the_codecs_first_lane_one_frame_goes_where_the_default_trip_waits_for_two(program):
    # 8 ms steps at 1.15: 7 of them plus DELIVERY_S (25 ms) is 89 ms, past a frame's 85 ms; where the
    # codec's first lane decodes second chunks at once, plus LANE_DELIVERY_S (15 ms), 79 ms
    from gpu_worker.windows import DELIVERY_S, LANE_DELIVERY_S

    assert (DELIVERY_S, LANE_DELIVERY_S) == (0.025, 0.015)
    got = chunks_of(program, "progressive", 0.008, codec_lane=True)
    assert (len(got[0].tokens) // 4, got[0].tail_rows) == (7, 7)
    assert (len(got[1].tokens) // 4, got[1].tail_rows) == (14, 7)  # the lane's second chunk
    assert (len(chunks_of(program, "progressive", 0.008)[0].tokens) // 4) == 14
    # past LANE_ROOM of the capacity the trip is allowed DELIVERY_S again: two frames
    from gpu_worker.windows import LANE_ROOM

    assert (
        len(chunks_of(program, "progressive", 0.008, codec_lane=True, load=LANE_ROOM)[0].tokens) // 4
    ) == 7
    assert (len(chunks_of(program, "progressive", 0.008, codec_lane=True, load=0.6)[0].tokens) // 4) == 14
    # ... a room the operator sets (--codec-first-lane-room): at 1, any load; at 0, never
    lane = dict(codec_lane=True, load=0.6)
    assert len(chunks_of(program, "progressive", 0.008, lane_room=1.0, **lane)[0].tokens) // 4 == 7
    assert (
        len(chunks_of(program, "progressive", 0.008, lane_room=0.0, codec_lane=True, load=0.01)[0].tokens)
        // 4
        == 14
    )


def test_the_first_chunk_margin_is_checked():
    from gpu_worker.scheduler.pacing import LEAD_MARGIN

    assert GpuWorkerSettings().first_chunk_margin == LEAD_MARGIN  # the steps' own margin by default
    GpuWorkerSettings(first_chunk_margin=1.0).check()
    for bad in (0.9, 2.5):
        with pytest.raises(ValueError, match="--first-chunk-margin"):
            GpuWorkerSettings(first_chunk_margin=bad).check()


@pytest.mark.parametrize("step_ms, first_rows, n_early", [(3.0, 7, 5), (8.0, 14, 5)])
def test_tails_until_the_stream_is_ahead_then_the_reference_windows(program, step_ms, first_rows, n_early):
    ref = chunks_of(program, "reference", step_ms / 1000)
    got = chunks_of(program, "progressive", step_ms / 1000)
    # The first chunk: one frame when the next one arrives before it has played out, 7 steps at
    # 1.15 plus DELIVERY_S (3 ms: 49 ms; 8 ms: 89 ms > 85 ms, so two frames, decoded whole).
    early = [c for c in got if c.tail_rows]
    assert got[:n_early] == early and len(early) == n_early
    assert (len(early[0].tokens) // 4, early[0].tail_rows) == (first_rows, first_rows)
    windows = [np.frombuffer(c.tokens, "<i4") for c in ref]  # window j: rows [7j, 7j + 28)
    full = np.concatenate([windows[0], *(w[-7:] for w in windows[1:])])  # the audio rows
    assert np.frombuffer(early[0].tokens, "<i4").tolist() == full[:first_rows].tolist()
    # Then one tail per frame (the newest frame after up to 3 of context) until the audio sent
    # not yet played covers the wait for the next regular window, 21 steps, at the step budget
    # where the steps run faster (10.7 ms each, with the margin and the trip: 284 ms): at 3 ms, 5
    # frames sent, 343 ms ahead; at 8 ms, 6 frames, 288 ms ahead.
    n = first_rows
    for c in early[1:]:
        n += 7
        assert (len(c.tokens) // 4, c.tail_rows) == (min(28, n), 7)
        assert np.frombuffer(c.tokens, "<i4").tolist() == full[max(0, n - 28) : n].tolist()
    assert [c.index for c in got] == list(range(len(got)))
    # Regular window j is frame j + 1: the rest are the reference's from the first frame not sent
    # early on, same tokens and noise streams.
    frames = n // 7
    rest = [(c.tokens, c.noise_id) for c in got[n_early:]]
    assert rest == [(c.tokens, c.noise_id) for c in ref[frames - 1 :]]


def test_a_slow_engine_keeps_sending_tails(program):
    got = chunks_of(program, "progressive", 0.013)  # slower than real time: never far enough ahead
    assert got[0].tail_rows == len(got[0].tokens) // 4 == 14  # two frames first: 7 steps take 105 ms
    assert all(c.tail_rows == 7 for c in got[1:])


def test_a_tail_window_is_the_newest_frame_of_its_window_decoded_whole(program):
    codec = Codec(program, max_batch=4, graphs=False, tails=True)
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for k, rows in enumerate((7, 14, 21, 28, 28)):
        tokens = 128266 + 4096 * (torch.arange(rows) % 7) + torch.randint(1, 4096, (rows,), generator=gen)
        noise = LEAD_NOISE_BASE + rows if k < 4 else 1
        chunks.append(DetokChunk("r", k, 9, tokens.int().numpy().astype("<i4").tobytes(), noise, tail_rows=7))
    out = codec.decode(chunks)
    assert [len(a.pcm) // 2 for a in out] == [2048] * 5
    for c, a in zip(chunks, out, strict=True):
        rows = len(c.tokens) // 4
        t = torch.from_numpy(np.frombuffer(c.tokens, "<i4").astype(np.int64)).view(1, rows, 1)
        keys = rng.mix_keys(torch.tensor([c.seed]), torch.tensor([c.noise_id]))
        levels, _ = program.codec.window_levels(t)
        whole = program.codec.decode_codes(levels, keys, crop=False)[0, 0]  # every sample of the window
        want = np.clip(np.round(whole[-2048:].numpy() * 32767), -32768, 32767)
        np.testing.assert_allclose(np.frombuffer(a.pcm, "<i2").astype(int), want.astype(int), atol=1)


def test_progressive_mode_serves_whole_wavs_through_every_process():
    srv = Server("--first-chunk", "progressive")
    try:
        body = json.dumps({"text": "Frame by frame.", "seed": 4, "max_tokens": 120, "streaming": False})
        req = urllib.request.Request(
            srv.base + "/generate", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            audio, rate = sf.read(io.BytesIO(r.read()), dtype="int16")
        assert rate == 24000 and len(audio) > 0 and len(audio) % 2048 == 0
    finally:
        srv.stop()


def test_a_stream_that_ends_before_its_first_chunk_left_still_sends_it(program):
    # At 13 ms a step the first chunk waits for a second frame; a stream of one frame ends first.
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=200, first_chunk="progressive"))
    for _ in range(10):
        eng.clock.record(1, 0.013)
    eng.clock.tick = lambda batch, streams=0, cost=None: None
    rows = np.array(PROMPT, dtype="<i4")
    sp = SamplingParams(max_tokens=len(rows) + 9, min_tokens=9, constrained=True, seed=3)  # 9 rows: 1 frame
    eng.add(Prompt("r", rows.tobytes(), len(rows), sp))
    got = [c for batch in eng.run_until_idle() for c in batch.chunks]
    assert [(len(c.tokens) // 4, c.tail_rows, c.noise_id) for c in got] == [(7, 7, LEAD_NOISE_BASE + 7)]
