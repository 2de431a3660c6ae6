"""Chatterbox's S3Gen codec on the GPU (the published sizes, random weights, float32, TF32 off):

1. A whole utterance's audio against chatterbox-tts 0.1.7's S3Token2Wav.inference (the same weights
   and random numbers) on the GPU.
2. The codec worker's stream graphs (captured `decode_stream` per batch bucket) against its eager
   decode: 8 streams of 3 one-second windows, interleaved.
3. The GPU time of one codec call per batch size (windows of 25 tokens, one second of audio each),
   reported as milliseconds per second of audio: the S3Gen stage's cost a stream.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from codec_worker.worker import Codec
from common.messages import DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class
from programs.chatterbox import codec as cd
from tests.chatterbox_reference import reference_decode, reference_s3gen

MODEL = "chatterbox"
DEVICE = "cuda"
R = 25


@pytest.fixture(scope="module")
def program():
    p = load_program_class(MODEL)(get_spec(MODEL), load_format="dummy", device=DEVICE)
    p.load_codec()
    return p


def test_whole_utterance_equals_the_reference_on_the_gpu(program, gpu_report):
    s3gen = program.codec
    ids = torch.randint(0, 6561, (100,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours = s3gen.decode(ids, 11)
    flow, hift = (m.to(DEVICE) for m in reference_s3gen(s3gen))
    keys = torch.tensor([11], device=DEVICE)
    frames = torch.arange(2 * (len(s3gen.prompt_tokens) + len(ids)), device=DEVICE)[None]
    samples = torch.arange(2 * len(ids) * cd.SAMPLES_PER_FRAME, device=DEVICE)[None]
    noise = {
        "flow": cd.flow_noise(keys, frames, s3gen.mels),
        "phases": cd.source_phases(keys, s3gen.harmonics),
        "source": cd.source_noise(keys, samples, s3gen.harmonics),
    }
    with torch.no_grad():
        want = reference_decode(flow, hift, s3gen, ids, noise)
    diff = float((ours - want.to(ours)).abs().max())
    gpu_report("chatterbox-s3gen")["whole_utterance_max_diff"] = diff
    assert diff < 1e-3, diff


def test_stream_graphs_match_the_eager_codec_and_report_the_call_time(program, gpu_report):
    gen = np.random.default_rng(2)
    ids = gen.integers(0, 6561, size=(8, 3 * R, 1)).astype("<i4")
    chunks = [
        DetokChunk(f"s{b}", j, 5 + b, ids[b, j * R : (j + 1) * R].tobytes(), j)
        for j in range(3)
        for b in range(8)
    ]
    pcm = {}
    for graphs in (True, False):
        codec = Codec(program, max_batch=16, graphs=graphs, streams=17)
        audio: dict[str, list[np.ndarray]] = {}
        for lo in range(0, len(chunks), 8):
            for a in codec.decode(chunks[lo : lo + 8]):
                audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
        pcm[graphs] = np.stack([np.concatenate(audio[f"s{b}"]) for b in range(8)]).astype(np.int32)
        codec.ended([Finished(f"s{b}", FinishReason.STOP) for b in range(8)])
    res = {"max_pcm_diff_graphs_vs_eager": int(np.abs(pcm[True] - pcm[False]).max())}
    res["codec_ms_per_audio_second"] = call_times(program, ids)
    gpu_report("chatterbox-s3gen")["codec"] = res
    assert res["max_pcm_diff_graphs_vs_eager"] <= 2, res


def test_float16_codec_call_time(gpu_report):
    """S3Gen in float16 (`--codec-dtype float16`): its GPU time per second of audio."""
    p = load_program_class(MODEL)(get_spec(MODEL), load_format="dummy", device=DEVICE, codec_dtype="float16")
    p.load_codec()
    ids = np.random.default_rng(2).integers(0, 6561, size=(8, R, 1)).astype("<i4")
    times = call_times(p, ids)
    gpu_report("chatterbox-s3gen")["codec_float16_ms_per_audio_second"] = times
    assert times[1] < 1000.0, times  # one stream keeps real time


def call_times(program, ids: np.ndarray) -> dict[int, float]:
    """Milliseconds of codec per second of audio at 1, 4 and 16 streams, each decoding 5 windows
    after its first (graphs)."""
    codec = Codec(program, max_batch=16, graphs=True, streams=17)
    ms_per_audio_s = {}
    for bs in (1, 4, 16):
        batch = [DetokChunk(f"t{bs}-{b}", 0, b, ids[b % 8, :R].tobytes(), 0) for b in range(bs)]
        codec.decode(batch)  # the streams' first windows
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for j in range(1, 6):
            codec.decode([DetokChunk(c.rid, j, c.seed, c.tokens, j) for c in batch])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        ms_per_audio_s[bs] = (time.perf_counter() - t0) * 1000 / (5 * bs)  # a window is 1 s of audio
        codec.ended([Finished(c.rid, FinishReason.STOP) for c in batch])
    return ms_per_audio_s
