"""On a GPU, `--codec-compile-leads`: Orpheus's lead windows (first chunks of 2 and 3 frames) through
the compiled SNAC decode, in graphs up to the codec's largest batch, decode in float32 to the
graphed uncompiled audio within one LSB; and in float16 a burst's pass of first chunks (128 lead
windows of 3 frames, as 128 young streams send them together) takes less GPU time than uncompiled
in graphs of the same size (`--codec-lead-batch 128`). The report holds the passes' times, with
the default's parts of 16 beside them, and each codec's startup (its compiles and graph captures)."""

from __future__ import annotations

import time

import numpy as np
from parity_checks import codec_pass_ms, compiled_orpheus_codec
from test_gpu_codec_lead_batch import leads

from codec_worker.codec import LEAD_MAX_BATCH, Codec


def codecs(dtype: str) -> tuple[dict[str, Codec], dict[str, float]]:
    """Orpheus's codec (dummy SNAC 24 kHz) in `dtype`, uncompiled with its lead windows in graphs of
    up to 16 (parts, the default) and of up to 128 (wide), and compiled with its leads (fast); each
    one's startup seconds (fast's: three compiles, regular windows and leads of 2 and 3 frames). No
    tail windows: fewer compiles, the lead windows' graphs the same. Asserts that fast's graphs of
    lead windows were captured through the compiled decode."""
    program, backend = compiled_orpheus_codec(dtype)
    compile_fn = program.compiled_detokenize
    rows_compiled = []

    def counting(b):
        fn = compile_fn(b)
        return lambda t, k, tail_rows=0: rows_compiled.append(t.shape[1]) or fn(t, k, tail_rows)

    program.compiled_detokenize = counting
    made, startup = {}, {}
    for name, kw in [
        ("parts", {}),
        ("wide", {"lead_batch": 128}),
        ("fast", {"compile_backend": backend, "compile_leads": True}),
    ]:
        t0 = time.perf_counter()
        made[name] = Codec(program, max_batch=128, **kw)
        startup[f"{name}_startup_s_{dtype}"] = time.perf_counter() - t0
    assert made["fast"].compile_leads == {14, 21} and {14, 21, 28} <= set(rows_compiled)
    assert made["fast"].limits[21, 0] == made["wide"].limits[21, 0] == 128
    assert made["parts"].limits[21, 0] == LEAD_MAX_BATCH
    return made, startup


def worst_lsb(a, b) -> int:
    return max(
        int(np.abs(np.frombuffer(x.pcm, "<i2").astype(int) - np.frombuffer(y.pcm, "<i2").astype(int)).max())
        for x, y in zip(a, b, strict=True)
    )


def test_lead_windows_compiled_decode_as_the_graphs_do_and_faster(gpu_report) -> None:
    chunks = leads(128, seed=1)
    mixed = leads(64, 3, rows=14) + leads(64, 4, rows=21)  # a loaded server's first chunks
    made, startup = codecs("float32")  # TF32 off (conftest): one LSB is the compiled tolerance
    worst = max(worst_lsb(made["fast"].decode(c), made["wide"].decode(c)) for c in (chunks, mixed))
    report = gpu_report("codec_compile_leads_orpheus")
    report |= {"pcm_max_lsb_float32": worst, **startup}
    made, startup = codecs("float16")  # as served
    report |= startup
    for name, codec in made.items():
        report[f"{name}_pass_ms_float16"] = codec_pass_ms(codec, chunks)
        report[f"{name}_mixed_pass_ms_float16"] = codec_pass_ms(codec, mixed)
    assert worst <= 1, report
    assert report["fast_pass_ms_float16"] < report["wide_pass_ms_float16"], report
