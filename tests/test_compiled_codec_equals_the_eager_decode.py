"""The compiled SNAC decode (`--codec-compile`): the cropped decode with its depthwise convolutions
as shifted sums (what torch.compile fuses with the Snakes around them) equals the convolution one,
and the compiled function equals the eager decode at every batch size while compiling a bounded
number of times (batch size 1, one dynamic batch size for the rest, and on a CPU one more for
batches of 16 and more: the CPU convolution's backend choice adds that guard). The codec_worker's
`Codec` compiles at startup, sends regular windows through it and everything else (lead windows)
through the program's `detokenize`, and under `--codec-compile auto` falls back to the eager
decode when compiling fails.

On CPU the compile uses the `aot_eager` backend: the same tracing and dynamic batch dimension as
the GPU's inductor, without needing a C++ toolchain here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from codec_worker.worker import Codec, codec_compile_backend
from common.messages import LEAD_NOISE_BASE, DetokChunk
from programs import get_spec, load_program_class
from programs.orpheus import snac_crop
from programs.orpheus.codec import SnacCodec

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "orpheus", "configs")


def _windows(seed: int, n: int, rows: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 4096, (n, rows), generator=torch.Generator().manual_seed(seed))
    tokens = (128266 + 4096 * (torch.arange(rows) % 7) + codes)[:, :, None]
    return tokens, torch.arange(100 * seed, 100 * seed + n, dtype=torch.int64)


@pytest.mark.parametrize("config", ["snac-tiny.json", "snac_24khz.json"])
def test_depthwise_taps_equal_the_convolution(config, monkeypatch) -> None:
    with open(os.path.join(CONFIGS, config)) as f:
        codec = SnacCodec.from_config(json.load(f), seed=0)
    taps = [
        op for op in codec.cropped_taps.chain.ops for op in getattr(op, "ops", [op]) if getattr(op, "taps", 0)
    ]
    assert len(taps) >= 4  # every residual unit's depthwise convolution (and conv in, when depthwise)
    tokens, keys = _windows(1, 3)
    calls = {"n": 0}
    real = snac_crop.F.conv1d

    def counting(*args, **kw):
        calls["n"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(snac_crop.F, "conv1d", counting)
    conv, _ = codec.decode_orpheus_window(tokens, keys)
    with_conv = calls["n"]
    summed, _ = codec.decode_orpheus_window(tokens, keys, taps=True)
    assert calls["n"] - with_conv == with_conv - len(taps)  # the taps replaced those convolutions
    torch.testing.assert_close(summed, conv, atol=2e-6, rtol=0)
    assert conv.abs().max() > 0.05  # not silence


@pytest.fixture(scope="module")
def compiled_codec():
    """orpheus-tiny's `Codec` compiled at startup (aot_eager) and the unique graphs its compiles
    made: one compile serves both tests below (compiling is most of their time)."""
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_codec()
    torch._dynamo.reset()
    before = counters["stats"]["calls_captured"], counters["stats"]["unique_graphs"]
    codec = Codec(program, max_batch=4, graphs=False, compile_backend="aot_eager")
    assert counters["stats"]["calls_captured"] > before[0]  # compiled at startup
    return program, codec, before[1]


def test_compiled_decode_equals_eager_at_every_batch_size_compiling_a_few_times(compiled_codec) -> None:
    program, codec, graphs_before = compiled_codec
    fn = codec.compiled
    for seed, n in enumerate((5, 3, 1, 2, 17, 7, 1, 20)):
        with torch.inference_mode():  # as the codec_worker makes its tensors and calls it
            tokens, keys = _windows(seed, n)
            tokens[0, 0, 0] = 5 if n == 3 else tokens[0, 0, 0]  # an invalid window stays flagged
            got, valid = fn(tokens, keys)
            want, want_valid = program.codec.decode_orpheus_window(tokens, keys)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        assert torch.equal(valid, want_valid)
    # The compiles at startup and any since, for every batch size above.
    assert 1 <= counters["stats"]["unique_graphs"] - graphs_before <= 3
    with pytest.raises(ValueError, match="28-row windows and whole lead windows"):
        fn(*_windows(0, 2, rows=35))


def _chunk(seed: int, index: int, rows: int) -> DetokChunk:
    tokens, _ = _windows(seed, 1, rows)
    noise_id = LEAD_NOISE_BASE + rows if rows < 28 else index
    return DetokChunk(
        f"r{seed}", index, seed=seed, tokens=tokens.int().numpy().astype("<i4").tobytes(), noise_id=noise_id
    )


def test_codec_worker_decodes_regular_windows_compiled_and_lead_windows_eagerly(
    compiled_codec, monkeypatch
) -> None:
    program, compiled, _ = compiled_codec
    plain = Codec(program, max_batch=4, graphs=False)
    calls = []
    fn = compiled.compiled
    monkeypatch.setattr(compiled, "compiled", lambda t, k: calls.append(len(t)) or fn(t, k))
    chunks = [_chunk(s, i, rows) for s, (i, rows) in enumerate([(0, 28), (0, 7), (1, 28), (0, 14), (2, 28)])]
    got, want = compiled.decode(chunks), plain.decode(chunks)
    # The three regular windows in one call (padded to the eager call size); the lead windows went elsewhere.
    assert calls == [compiled.eager_batch] and compiled.eager_batch >= 3
    assert [(a.rid, a.index, len(a.pcm)) for a in got] == [(a.rid, a.index, len(a.pcm)) for a in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.frombuffer(a.pcm, "<i2").astype(int), np.frombuffer(b.pcm, "<i2").astype(int), atol=1
        )


def test_codec_compile_setting(monkeypatch) -> None:
    orpheus = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    csm = load_program_class("csm-tiny")(get_spec("csm-tiny"), load_format="dummy")
    assert codec_compile_backend("off", "cuda", orpheus, True) is None
    assert codec_compile_backend("on", "cpu", orpheus, False) == "inductor"
    assert codec_compile_backend("auto", "cpu", orpheus, True) is None  # a CPU: not worth a compile
    assert codec_compile_backend("auto", "cuda", orpheus, False) is None  # eager windows on a GPU
    assert codec_compile_backend("auto", "cuda", csm, True) is None  # no compiled Mimi
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    assert codec_compile_backend("auto", "cuda:1", orpheus, True) == "inductor"  # a GPU with Triton
    assert codec_compile_backend("auto", "cuda", csm, True) is None
    csm.load_codec()
    with pytest.raises(ValueError, match="no compiled codec"):
        Codec(csm, max_batch=2, graphs=False, compile_backend="inductor", streams=1)


def _no_compiler(gm, example_inputs):
    raise RuntimeError("no C compiler on this host")


def test_a_compile_that_fails_falls_back_to_the_eager_decode_under_auto_only() -> None:
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_codec()
    chunks = [_chunk(s, i, rows) for s, (i, rows) in enumerate([(0, 28), (0, 7), (1, 28)])]
    want = Codec(program, max_batch=4, graphs=False).decode(chunks)
    torch._dynamo.reset()
    auto = Codec(program, max_batch=4, graphs=False, compile_backend=_no_compiler, compile_fallback=True)
    assert auto.compiled is None  # the compile at startup failed: regular windows decode uncompiled
    assert [a.pcm for a in auto.decode(chunks)] == [b.pcm for b in want]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no C compiler"):
        Codec(program, max_batch=4, graphs=False, compile_backend=_no_compiler)
