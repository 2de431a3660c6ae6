"""Qwen3-TTS's compiled codec (`compiled_detokenize`, `--codec-compile`): the codec_worker's `Codec`
sends every window a stream continues, a single frame or merged frames, through the compiled decode,
and its audio equals the uncompiled Codec's for the same chunks: fresh streams, continued ones, a
slot taken over by a new request, and waiting windows merged. Each decode carries the streams' state
forward in place, so any divergence of state (a copy written back wrongly, a stale slot) shows in
the later windows.

On a CPU the compile uses the `aot_eager` backend: the same tracing and in-place state updates as
the GPU's inductor, without a C++ toolchain (its arithmetic is the eager one's: equal PCM). It
compiles twice: for one-frame windows, and once for every longer window (their length dynamic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from codec_worker.codec import Codec
from common.messages import DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class


def _chunks(program, rid: str, first: int, n: int, seed: int) -> list[DetokChunk]:
    c = program.n_codebooks
    rows = np.random.default_rng(seed).integers(0, program.codec.codebook_size, (first + n, c)).astype("<i4")
    return [DetokChunk(rid, j, seed, rows[j : j + 1].tobytes(), j) for j in range(first, first + n)]


def _pcm(codec: Codec, chunks: list[DetokChunk]) -> dict:
    return {(a.rid, a.index): np.frombuffer(a.pcm, "<i2").astype(np.int32) for a in codec.decode(chunks)}


def _program():
    prog = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    prog.load_codec()
    return prog


@pytest.fixture(scope="module")
def program():
    return _program()


def test_compiled_stream_decode_equals_the_eager_one_for_single_and_merged_windows(program, monkeypatch):
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    # two programs with the same random weights: a program's codec holds one Codec's stream state
    plain = Codec(program, max_batch=4, graphs=False, streams=6, merge=8)
    compiled = Codec(_program(), max_batch=4, graphs=False, streams=6, merge=8, compile_backend="aot_eager")
    assert compiled.compiled is not None and plain.compiled is None
    calls = []
    fn = compiled.compiled
    monkeypatch.setattr(
        compiled, "compiled", lambda t, k, streams: calls.append(t.shape[1]) or fn(t, k, streams=streams)
    )
    # passes: three fresh streams' first frames; each a frame more; a stream 5 frames behind
    # (merged), one ended and its slot taken by a new request, then everyone a frame more
    passes = [
        [c for s in range(3) for c in _chunks(program, f"a{s}", 0, 1, s)],
        [c for s in range(3) for c in _chunks(program, f"a{s}", 1, 1, s)],
        _chunks(program, "a0", 2, 5, 0) + _chunks(program, "a1", 2, 1, 1),
        "end a2",
        _chunks(program, "b0", 0, 2, 7) + _chunks(program, "a1", 3, 1, 1),
        [
            c
            for rid, s, j in (("a0", 0, 7), ("a1", 1, 4), ("b0", 7, 2))
            for c in _chunks(program, rid, j, 1, s)
        ],
    ]
    got, want = {}, {}
    for p in passes:
        if isinstance(p, str):
            for codec in (plain, compiled):
                codec.ended([Finished(p.split()[1], FinishReason.STOP)])
            continue
        want |= _pcm(plain, p)
        got |= _pcm(compiled, p)
    assert got.keys() == want.keys() and len(got) == sum(len(p) for p in passes if not isinstance(p, str))
    for key, audio in want.items():
        assert len(audio) and np.array_equal(got[key], audio), key
    assert {1, 2, 4} <= set(calls)  # single frames and merged windows went through it
    # two compiles: one-frame windows, and every longer window (its length dynamic)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    assert max(np.abs(a).max() for a in want.values()) > 1000  # not silence


def test_codec_compile_auto_compiles_the_stream_decode_on_a_gpu(program, monkeypatch):
    import torch.utils._triton

    from codec_worker.worker import codec_compile_backend

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    assert codec_compile_backend("auto", "cuda", program, True) == "inductor"
    assert codec_compile_backend("auto", "cpu", program, True) is None
