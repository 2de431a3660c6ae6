"""On a GPU, `--codec-first-lane`: Orpheus's first and second chunks decoded in the first lane
(graphs of the lead kinds and the second chunks' tail kinds of their own, on a high-priority CUDA
stream) give the pass's audio bit for bit, and first chunks launched while a large pass of regular
windows runs: the report holds when each of the two finished after the lane's launch (polled
side by side), and the lane alone for comparison; the same for one first chunk of one frame, what a
lane launch holds while serving. No order is asserted: the GPU has run the lane's
graphs to the end of the pass they run beside (see the results of record)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from parity_checks import compiled_orpheus_codec
from test_gpu_codec_lead_batch import leads

from codec_worker.codec import Codec
from common.messages import DetokChunk


def regular(n: int, seed: int) -> list[DetokChunk]:
    """n regular windows (28 rows) of playing streams (chunk 3 each)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4096, (n, 28, 1), generator=gen)
    tokens = (128266 + 4096 * (torch.arange(28) % 7)[None, :, None] + codes).int().numpy().astype("<i4")
    return [DetokChunk(f"s{seed}-{i}", 3, 7 + i, tokens[i].tobytes(), 3) for i in range(n)]


def seconds(n: int, seed: int, rows: int) -> list[DetokChunk]:
    """n second chunks: the newest frame after `rows` - 7 rows as a tail window (chunk 1 each)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4096, (n, rows, 1), generator=gen)
    tokens = (128266 + 4096 * (torch.arange(rows) % 7)[None, :, None] + codes).int().numpy().astype("<i4")
    return [DetokChunk(f"t{seed}-{i}", 1, 31 + i, tokens[i].tobytes(), 0, tail_rows=7) for i in range(n)]


def finished_ms(codec: Codec, launches: list, t0: float) -> list[float]:
    """Poll launches side by side until each decode is done on the device: each one's ms after t0."""
    done: dict[int, float] = {}
    while len(done) < len(launches):
        for i, launched in enumerate(launches):
            if i not in done and codec.done(launched):
                done[i] = 1000 * (time.perf_counter() - t0)
    return [done[i] for i in range(len(launches))]


def test_first_and_second_chunks_in_the_lane_decode_as_in_a_pass_and_beside_one(gpu_report) -> None:
    program, backend = compiled_orpheus_codec("float16")
    codec = Codec(
        program, max_batch=128, tails=True, compile_backend=backend, compile_leads=True, first_lane=True
    )
    kinds = {(7, 0), (14, 0), (21, 0), (14, 7), (21, 7), (28, 7)}
    assert codec.lane is not None and set(codec.lane.graphs) == kinds
    firsts = leads(4, 1, rows=7) + leads(4, 2, rows=14) + leads(4, 3, rows=21)
    firsts += seconds(3, 4, rows=14) + seconds(3, 5, rows=21) + seconds(3, 6, rows=28)
    assert all(codec.lane_takes(c) for c in firsts) and not any(codec.lane_takes(c) for c in regular(2, 0))
    in_pass = codec.collect(codec.launch(firsts))
    in_lane = codec.collect(codec.launch(firsts, lane=True))
    assert [a.pcm for a in in_lane] == [a.pcm for a in in_pass]
    report = gpu_report("codec_first_lane_orpheus")
    # The lane alone, then beside a pass of 128 regular windows launched just before it.
    big = regular(128, 0)
    for _ in range(3):  # warm
        codec.collect(codec.launch(firsts, lane=True))
    t0 = time.perf_counter()
    alone = codec.launch(firsts, lane=True)
    report["lane_alone_ms"] = finished_ms(codec, [alone], t0)[0]
    codec.collect(alone)
    big_alone = [a.pcm for a in codec.collect(codec.launch(big))]
    rows = []
    for _ in range(5):
        torch.cuda.synchronize()
        in_flight = codec.launch(big)
        t0 = time.perf_counter()
        lane = codec.launch(firsts, lane=True)
        rows.append(tuple(finished_ms(codec, [lane, in_flight], t0)))
        # side by side on the device, each its own audio still (no buffer or pool shared)
        assert [a.pcm for a in codec.collect(lane)] == [a.pcm for a in in_pass]
        assert [a.pcm for a in codec.collect(in_flight)] == big_alone
    report["beside_a_pass_ms"] = [{"lane": round(a, 2), "pass": round(b, 2)} for a, b in rows]
    lane_med, pass_med = np.median([a for a, _ in rows]), np.median([b for _, b in rows])
    report["lane_median_ms"], report["pass_median_ms"] = float(lane_med), float(pass_med)
    # What a lane launch holds while serving: one first chunk of one frame, alone and beside the
    # pass (one graph replay: how far the stream's priority carries it past the pass's kernels)
    one = leads(1, 7, rows=7)
    for _ in range(3):
        codec.collect(codec.launch(one, lane=True))
    single = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        alone = codec.launch(one, lane=True)
        t_alone = finished_ms(codec, [alone], t0)[0]
        codec.collect(alone)
        torch.cuda.synchronize()
        in_flight = codec.launch(big)
        t0 = time.perf_counter()
        lane = codec.launch(one, lane=True)
        single.append((t_alone, *finished_ms(codec, [lane, in_flight], t0)))
        codec.collect(lane)
        assert [a.pcm for a in codec.collect(in_flight)] == big_alone
    report["one_frame_lead"] = {
        key: float(np.median([r[i] for r in single]))
        for i, key in enumerate(("alone_ms", "beside_a_pass_ms", "pass_ms"))
    }


def test_a_lane_that_fails_to_capture_stops_the_codecs_startup(monkeypatch) -> None:
    program, _ = compiled_orpheus_codec("float16")

    def fail(self, progress):
        raise torch.cuda.OutOfMemoryError("no room for the lane's graphs")

    monkeypatch.setattr(Codec, "_capture_lane", fail)
    with pytest.raises(RuntimeError, match="--codec-first-lane: capturing its graphs failed .*no room"):
        Codec(program, max_batch=16, tails=True, first_lane=True)
