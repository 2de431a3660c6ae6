"""`--codec-compile-tails`: with progressive first chunks, the tail windows of a full window (a
stream's newest frame after 28 rows of context, until it switches to regular windows) go through the
compiled SNAC decode as regular windows do, and equal the eager tail decode; shorter tails and lead
windows do not. A tail compile that fails falls back for the tails alone (under `--codec-compile
auto`), the regular windows staying compiled. On a CPU the compile uses `aot_eager` (as
tests/test_compiled_codec_equals_the_eager_decode.py explains)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from common.messages import LEAD_NOISE_BASE, DetokChunk
from common.options import parse_role
from tests.conftest import tiny_codec
from tests.test_compiled_codec_equals_the_eager_decode import _windows


@pytest.fixture(scope="module")
def program():
    return tiny_codec()


@pytest.fixture(scope="module")
def codec(program):
    """orpheus-tiny's `Codec` with compiled tails, compiled at startup (aot_eager): one compile serves
    every test below (compiling is most of their time); each sets what it changes back."""
    torch._dynamo.reset()
    return Codec(
        program, max_batch=4, graphs=False, compile_backend="aot_eager", tails=True, compile_tails=True
    )


@pytest.fixture
def compiled(codec):
    return codec.compiled


def test_the_compiled_decode_of_a_full_windows_tail_equals_the_eager_one(program, compiled) -> None:
    for seed, n in enumerate((3, 1, 17, 5)):
        with torch.inference_mode():
            tokens, keys = _windows(seed, n)
            got, valid = compiled(tokens, keys, tail_rows=7)
            want, want_valid = program.codec.decode_orpheus_window(tokens, keys, tail_rows=7)
            regular, _ = compiled(tokens, keys)
        assert got.shape == (n, 2048)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        assert torch.equal(valid, want_valid)
        assert not torch.allclose(got, regular)  # the last frame's samples, not the kept second frame's
    with pytest.raises(ValueError, match="whole frames"):
        compiled(*_windows(0, 2), tail_rows=5)


def _tail(seed: int, index: int, rows: int) -> DetokChunk:
    """Chunk `index` of a progressive stream: its newest frame after `rows` rows of context."""
    tokens, _ = _windows(seed, 1, rows)
    noise_id = LEAD_NOISE_BASE + rows if rows < 28 else index
    return DetokChunk(
        f"r{seed}", index, seed=seed, tokens=tokens.int().numpy().astype("<i4").tobytes(), noise_id=noise_id,
        tail_rows=7,
    )  # fmt: skip


def _pcm(chunks) -> list[np.ndarray]:
    return [np.frombuffer(c.pcm, "<i2").astype(int) for c in chunks]


@pytest.mark.parametrize("on", [True, False])
def test_the_codec_worker_sends_full_windows_tails_through_the_compiled_decode(
    program, codec, monkeypatch, on
):
    monkeypatch.setattr(codec, "compile_tails", on)
    plain = Codec(program, max_batch=4, graphs=False, tails=True)
    calls = []
    fn = codec.compiled
    monkeypatch.setattr(
        codec, "compiled", lambda t, k, tail_rows=0: calls.append(tail_rows) or fn(t, k, tail_rows)
    )
    # two full-context tails, one shorter tail (14 rows), a regular window
    chunks = [_tail(0, 3, 28), _tail(1, 2, 14), _tail(2, 5, 28)]
    regular = DetokChunk("r3", 4, seed=3, tokens=chunks[0].tokens, noise_id=4)
    got, want = codec.decode([*chunks, regular]), plain.decode([*chunks, regular])
    assert sorted(calls) == ([0, 7] if on else [0])  # one call for the two full tails, one regular
    assert [(a.rid, a.index, len(a.pcm)) for a in got] == [(a.rid, a.index, len(a.pcm)) for a in want]
    for a, b in zip(_pcm(got), _pcm(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1)


def test_a_failing_tail_compile_falls_back_for_the_tails_alone(program, codec, monkeypatch) -> None:
    fn = codec.compiled

    def failing(t, k, tail_rows=0):
        if tail_rows:
            raise RuntimeError("no kernel for this shape")
        return fn(t, k)

    monkeypatch.setattr(codec, "compiled", failing)
    monkeypatch.setattr(codec, "compile_tails", True)
    monkeypatch.setattr(codec, "compile_fallback", False)  # --codec-compile on: the request fails
    launched = codec.launch([_tail(0, 3, 28)])
    assert codec.collect(launched) == [] and "no kernel" in launched.failed["r0"].message
    monkeypatch.setattr(codec, "compile_fallback", True)  # auto: the tails fall back
    want = Codec(program, max_batch=4, graphs=False, tails=True).decode([_tail(1, 3, 28)])
    assert [a.pcm for a in codec.decode([_tail(1, 3, 28)])] == [b.pcm for b in want]
    assert codec.compile_tails is False and codec.compiled is failing  # the regular windows: compiled still


def test_the_setting_reaches_the_codec_worker() -> None:
    assert parse_role("codec_worker", ["--model", "orpheus-tiny"], {}).cfg.codec.compile_tails  # the default
    assert not parse_role(
        "codec_worker", ["--model", "orpheus-tiny", "--no-codec-compile-tails"], {}
    ).cfg.codec.compile_tails
