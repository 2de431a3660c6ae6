"""Merged codec windows on the GPU (programs/base.py `codec_merge`, `--codec-merge`), for each
program whose codec stream merges (dummy weights, real configs): through the codec graphs, 16
streams each with W windows waiting decode merged (up to 8) and window by window; each chunk's PCM
agrees within one LSB; the report gives both decodes' times, the graphs' capture time per setting,
and the time of a stream's first windows waiting together (its silent ones and its first audible
ones).

    VOXPIPE_GPU_REPORT_DIR=out python -m pytest -s tests/gpu/test_gpu_codec_merge.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from common.messages import DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class

STREAMS, WINDOWS = 16, 8


def chunks_of(program, rid: str, first: int, n: int, seed: int) -> list[DetokChunk]:
    r, c = program.detok_interval, program.n_codebooks
    rows = np.random.default_rng(seed).integers(0, 1000, ((first + n) * r, c)).astype("<i4")
    return [DetokChunk(rid, j, seed, rows[j * r : (j + 1) * r].tobytes(), j) for j in range(first, first + n)]


def timed(codec: Codec, chunks: list[DetokChunk]) -> tuple[dict, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = {(a.rid, a.index): np.frombuffer(a.pcm, "<i2").astype(np.int32) for a in codec.decode(chunks)}
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("name", ["qwen3-tts", "higgs-tts", "csm"])
def test_merged_windows_on_the_gpu_equal_window_by_window_and_report_their_time(name, gpu_report):
    program = load_program_class(name)(get_spec(name), load_format="dummy", device="cuda")
    program.load_codec()
    res = gpu_report("codec-merge").setdefault(name, {})
    audio = {}
    for merge in (1, 8):
        t0 = time.perf_counter()
        codec = Codec(program, max_batch=16, graphs=True, streams=2 * STREAMS, merge=merge)
        res[f"capture_s_merge_{merge}"] = round(time.perf_counter() - t0, 2)
        first = [c for s in range(STREAMS) for c in chunks_of(program, f"s{s}", 0, 1, s)]
        later = [c for s in range(STREAMS) for c in chunks_of(program, f"s{s}", 0, 1 + WINDOWS, s)[1:]]
        got, _ = timed(codec, first)
        more, seconds = timed(codec, later)  # every stream WINDOWS behind
        audio[merge] = got | more
        res[f"ms_{STREAMS}_streams_{WINDOWS}_windows_behind_merge_{merge}"] = round(1e3 * seconds, 2)
        lone = chunks_of(program, "lone", 0, 1 + program.detok_silent + program.detok_first_windows, 99)
        _, seconds = timed(codec, lone)  # a first chunk with the windows before it
        res[f"ms_first_chunk_with_{len(lone) - 1}_windows_before_merge_{merge}"] = round(1e3 * seconds, 2)
        codec.ended(
            [Finished(f"s{s}", FinishReason.STOP) for s in range(STREAMS)]
            + [Finished("lone", FinishReason.STOP)]
        )
    assert audio[1].keys() == audio[8].keys()
    worst = max((int(np.abs(a - audio[8][k]).max()) for k, a in audio[1].items() if len(a)), default=0)
    res["max_pcm_diff"] = worst
    assert all(len(a) == len(audio[8][k]) for k, a in audio[1].items()) and worst <= 1
