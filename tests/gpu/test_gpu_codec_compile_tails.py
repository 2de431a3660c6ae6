"""On a GPU, `--codec-compile-tails`: Orpheus's full-context tail windows (a progressive stream's
newest frame) through the compiled SNAC decode, in graphs up to the codec's largest batch, decode in
float32 to the graphed uncompiled audio within one LSB; and in float16 a burst's pass of them (128
tail windows, as 128 young streams send them together) takes less GPU time. The report holds both
passes' times."""

from __future__ import annotations

import numpy as np
import torch
from parity_checks import codec_pass_ms, compiled_orpheus_codec

from codec_worker.codec import Codec
from common.messages import DetokChunk


def tails(n: int, seed: int) -> list[DetokChunk]:
    """n tail windows of 28 rows (random codes), each stream's chunk 3."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4096, (n, 28, 1), generator=gen)
    tokens = (128266 + 4096 * (torch.arange(28) % 7)[None, :, None] + codes).int().numpy().astype("<i4")
    return [DetokChunk(f"t{seed}-{i}", 3, 11 + i, tokens[i].tobytes(), 3, tail_rows=7) for i in range(n)]


def codecs(dtype: str) -> tuple[Codec, Codec]:
    """Orpheus's codec (dummy SNAC 24 kHz) in `dtype`: tails graphed uncompiled, and compiled."""
    program, backend = compiled_orpheus_codec(dtype)
    plain = Codec(program, max_batch=128, tails=True)
    fast = Codec(program, max_batch=128, tails=True, compile_backend=backend, compile_tails=True)
    assert fast.compile_tails and fast.limits[28, 7] == 128 and plain.limits[28, 7] == 16
    return plain, fast


def test_full_context_tails_compiled_decode_as_the_graphs_do_and_faster(gpu_report) -> None:
    chunks = tails(128, seed=1)
    plain, fast = codecs("float32")  # TF32 off (conftest): one LSB is within the compiled tolerance
    worst = max(
        int(np.abs(np.frombuffer(a.pcm, "<i2").astype(int) - np.frombuffer(b.pcm, "<i2").astype(int)).max())
        for a, b in zip(fast.decode(chunks), plain.decode(chunks), strict=True)
    )
    report = gpu_report("codec_compile_tails_orpheus")
    report["pcm_max_lsb_float32"] = worst
    plain, fast = codecs("float16")  # as served
    report |= {
        "plain_pass_ms_float16": codec_pass_ms(plain, chunks),
        "fast_pass_ms_float16": codec_pass_ms(fast, chunks),
    }
    assert worst <= 1
    assert report["fast_pass_ms_float16"] < report["plain_pass_ms_float16"]
