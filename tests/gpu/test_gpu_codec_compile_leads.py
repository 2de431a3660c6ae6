"""On a GPU, `--codec-compile-leads`: Orpheus's lead windows (first chunks of 2 and 3 frames) through
the compiled SNAC decode, in graphs up to the codec's largest batch, decode in float32 to the
graphed uncompiled audio within one LSB; and in float16 a burst's pass of first chunks (128 lead
windows of 3 frames, as 128 young streams send them together) takes less GPU time than uncompiled
in parts of 16. The report holds both passes' times and each codec's startup (its compiles and
graph captures)."""

from __future__ import annotations

import time

import numpy as np
from parity_checks import codec_pass_ms, compiled_orpheus_codec
from test_gpu_codec_lead_batch import leads

from codec_worker.codec import LEAD_MAX_BATCH, Codec


def codecs(dtype: str) -> tuple[Codec, Codec, dict[str, float]]:
    """Orpheus's codec (dummy SNAC 24 kHz) in `dtype`: uncompiled (its lead windows graphed as
    served without --codec-compile-leads), and compiled with its leads; each one's startup seconds
    (the compiled one's: three compiles, regular windows and leads of 2 and 3 frames). No tail
    windows: fewer compiles, the lead windows' graphs the same."""
    program, backend = compiled_orpheus_codec(dtype)
    t0 = time.perf_counter()
    plain = Codec(program, max_batch=128)
    t1 = time.perf_counter()
    fast = Codec(program, max_batch=128, compile_backend=backend, compile_leads=True)
    t2 = time.perf_counter()
    assert fast.compile_leads and fast.limits[21, 0] == 128 and plain.limits[21, 0] == LEAD_MAX_BATCH
    return plain, fast, {f"plain_startup_s_{dtype}": t1 - t0, f"fast_startup_s_{dtype}": t2 - t1}


def worst_lsb(a, b) -> int:
    return max(
        int(np.abs(np.frombuffer(x.pcm, "<i2").astype(int) - np.frombuffer(y.pcm, "<i2").astype(int)).max())
        for x, y in zip(a, b, strict=True)
    )


def test_lead_windows_compiled_decode_as_the_graphs_do_and_faster(gpu_report) -> None:
    chunks = leads(128, seed=1)
    mixed = leads(64, 3, rows=14) + leads(64, 4, rows=21)  # a loaded server's first chunks
    plain, fast, startup = codecs("float32")  # TF32 off (conftest): one LSB is the compiled tolerance
    worst = max(worst_lsb(fast.decode(c), plain.decode(c)) for c in (chunks, mixed))
    report = gpu_report("codec_compile_leads_orpheus")
    report |= {"pcm_max_lsb_float32": worst, **startup}
    plain, fast, startup = codecs("float16")  # as served
    report |= {
        **startup,
        "plain_pass_ms_float16": codec_pass_ms(plain, chunks),
        "fast_pass_ms_float16": codec_pass_ms(fast, chunks),
        "plain_mixed_pass_ms_float16": codec_pass_ms(plain, mixed),
        "fast_mixed_pass_ms_float16": codec_pass_ms(fast, mixed),
    }
    assert worst <= 1, report
    assert report["fast_pass_ms_float16"] < report["plain_pass_ms_float16"], report
