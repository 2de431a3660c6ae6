"""Qwen3-TTS's compiled codec streams on the GPU (`--codec-compile`, dummy weights, decoder float16):
the codec_worker's `Codec` with the compiled decode in its graphs, in calls of 4 windows (so a
graph runs several calls side by side on its streams, each updating its own slots' state in
place), against the uncompiled graphs of a second program with the same weights: 16 streams, a
first frame each, then frames one at a time and merged (2, 4, 8), then a slot taken over by a new
stream. Each stream's audio agrees within float16 rounding (SNR, reported with the largest PCM
difference); a state written to the wrong slot, or lost between calls, would not.

    VOXPIPE_GPU_REPORT_DIR=out python -m pytest -s tests/gpu/test_gpu_qwen3_tts_compiled_codec.py
"""

from __future__ import annotations

import numpy as np
import torch

from codec_worker.codec import Codec
from common.messages import DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class

STREAMS = 16


def _program():
    program = load_program_class("qwen3-tts")(
        get_spec("qwen3-tts"), load_format="dummy", device="cuda", codec_dtype="float16"
    )
    program.load_codec()
    return program


def _chunks(rid: str, first: int, n: int, seed: int) -> list[DetokChunk]:
    rows = np.random.default_rng(seed).integers(0, 2048, (first + n, 16)).astype("<i4")
    return [DetokChunk(rid, j, seed, rows[j : j + 1].tobytes(), j) for j in range(first, first + n)]


def test_compiled_codec_streams_in_graphs_agree_with_the_uncompiled_graphs(gpu_report):
    kw = dict(max_batch=32, graphs=True, streams=2 * STREAMS, merge=8, call_batch=4)
    plain = Codec(_program(), **kw)
    compiled = Codec(_program(), compile_backend="inductor", **kw)
    assert compiled.compiled is not None
    passes = [  # (frames each stream sends this pass, streams), in order
        (1, range(STREAMS)),
        (1, range(STREAMS)),
        (2, range(0, STREAMS, 2)),
        (4, range(1, STREAMS, 2)),
        (8, range(STREAMS // 2)),
        (1, range(STREAMS)),
    ]
    sent = dict.fromkeys(range(STREAMS), 0)
    audio: dict[str, dict] = {"plain": {}, "compiled": {}}
    for n, streams in passes:
        chunks = [c for s in streams for c in _chunks(f"s{s}", sent[s], n, s)]
        for s in streams:
            sent[s] += n
        for name, codec in (("plain", plain), ("compiled", compiled)):
            for a in codec.decode(chunks):
                audio[name].setdefault(a.rid, []).append((a.index, np.frombuffer(a.pcm, "<i2")))
    # a slot taken over: stream 0 ends, a new stream starts (its slot may be stream 0's)
    for codec in (plain, compiled):
        codec.ended([Finished("s0", FinishReason.STOP)])
    for name, codec in (("plain", plain), ("compiled", compiled)):
        for a in codec.decode(_chunks("new", 0, 3, 99)):
            audio[name].setdefault(a.rid, []).append((a.index, np.frombuffer(a.pcm, "<i2")))
    snr, worst = {}, 0
    for rid, parts in audio["plain"].items():
        want = np.concatenate([p for _, p in sorted(parts, key=lambda x: x[0])]).astype(np.float64)
        got = np.concatenate([p for _, p in sorted(audio["compiled"][rid], key=lambda x: x[0])])
        got = got.astype(np.float64)
        assert len(got) == len(want) == 1920 * (sent.get(int(rid[1:]), 0) if rid != "new" else 3)
        snr[rid] = float(10 * np.log10((want**2).sum() / max(((got - want) ** 2).sum(), 1e-30)))
        worst = max(worst, int(np.abs(got - want).max()))
    report = gpu_report("qwen3-tts-compiled-codec")
    report["snr_db_compiled_vs_uncompiled"] = {"min": round(min(snr.values()), 2), "per_stream": snr}
    report["max_pcm_diff"] = worst
    report["frames_per_stream"] = sent
    assert min(snr.values()) > 30.0, snr  # float16 rounding differs (~41 dB); a wrong state does not
    torch.cuda.synchronize()
