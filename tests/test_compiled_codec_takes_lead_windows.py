"""`--codec-compile-leads`: Orpheus's lead windows of 2 and 3 frames (a loaded server's first
chunks, decoded whole) go through the compiled SNAC decode as regular windows do, in graphs up to
the codec's largest batch (a burst's streams send their first chunks together), and equal the
uncompiled lead decode; a 1-frame lead decodes uncompiled (a compile less at startup). Off,
they decode uncompiled in graphs of up to `--codec-lead-batch`. A lead compile that fails falls
back for the lead windows alone (under `--codec-compile auto`), the regular windows staying
compiled. On a CPU the compile uses `aot_eager` (as
tests/test_compiled_codec_equals_the_eager_decode.py explains)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.codec import LEAD_MAX_BATCH, Codec
from common.options import parse_role
from tests.conftest import tiny_codec
from tests.test_compiled_codec_equals_the_eager_decode import _chunk, _windows

LEADS = (7, 14, 21)


@pytest.fixture(scope="module")
def program():
    return tiny_codec()


@pytest.fixture(scope="module")
def codec(program):
    """orpheus-tiny's `Codec` with compiled lead windows, compiled at startup (aot_eager): one
    compile serves every test below; each sets what it changes back."""
    torch._dynamo.reset()
    return Codec(program, max_batch=4, graphs=False, compile_backend="aot_eager", compile_leads=True)


def test_the_compiled_decode_of_lead_windows_equals_the_eager_one(program, codec) -> None:
    assert program.detok_lead == LEADS and program.codec_compiled_leads == (14, 21)
    assert codec.compile_leads == {14, 21}  # a 1-frame lead: uncompiled
    for seed, (rows, n) in enumerate([(7, 3), (14, 1), (21, 5), (21, 17), (14, 2)]):
        with torch.inference_mode():
            tokens, keys = _windows(seed, n, rows)
            tokens[0, 0, 0] = 5 if n == 3 else tokens[0, 0, 0]  # an invalid window stays flagged
            got, valid = codec.compiled(tokens, keys)
            want, want_valid = program.codec.decode_orpheus_window(tokens, keys)
        assert got.shape == (n, rows // 7 * 2048)  # the whole lead window's audio
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        assert torch.equal(valid, want_valid)
    with pytest.raises(ValueError, match="whole lead windows"):  # a lead size's tail is no lead window
        codec.compiled(*_windows(0, 2, 14), tail_rows=7)


def _pcm(chunks) -> list[np.ndarray]:
    return [np.frombuffer(c.pcm, "<i2").astype(int) for c in chunks]


@pytest.mark.parametrize("on", [True, False])
def test_the_codec_sends_lead_windows_through_the_compiled_decode(program, codec, monkeypatch, on) -> None:
    monkeypatch.setattr(codec, "compile_leads", {14, 21} if on else set())
    plain = Codec(program, max_batch=4, graphs=False)
    calls = []
    fn = codec.compiled
    monkeypatch.setattr(
        codec, "compiled", lambda t, k, tail_rows=0: calls.append(t.shape[1]) or fn(t, k, tail_rows)
    )
    chunks = [_chunk(s, i, rows) for s, (i, rows) in enumerate([(0, 28), (0, 7), (0, 21), (1, 28), (0, 21)])]
    got, want = codec.decode(chunks), plain.decode(chunks)
    # one call for the regular windows, and with compiled leads one for the 3-frame leads (a
    # 1-frame lead decodes uncompiled)
    assert sorted(calls) == ([21, 28] if on else [28])
    assert [(a.rid, a.index, len(a.pcm)) for a in got] == [(a.rid, a.index, len(a.pcm)) for a in want]
    for a, b in zip(_pcm(got), _pcm(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1)


def test_a_failing_lead_compile_falls_back_for_the_lead_windows_alone(program, codec, monkeypatch) -> None:
    fn = codec.compiled

    def failing(t, k, tail_rows=0):
        if t.shape[1] < 28:
            raise RuntimeError("no kernel for this shape")
        return fn(t, k, tail_rows)

    monkeypatch.setattr(codec, "compiled", failing)
    monkeypatch.setattr(codec, "compile_leads", {14, 21})
    monkeypatch.setattr(codec, "compile_fallback", False)  # --codec-compile on: the request fails
    launched = codec.launch([_chunk(0, 0, 21)])
    assert codec.collect(launched) == [] and "no kernel" in launched.failed["r0"].message
    monkeypatch.setattr(codec, "compile_fallback", True)  # auto: the lead windows fall back
    want = Codec(program, max_batch=4, graphs=False).decode([_chunk(1, 0, 21), _chunk(2, 1, 28)])
    got = codec.decode([_chunk(1, 0, 21), _chunk(2, 1, 28)])
    assert [a.pcm for a in got[:1]] == [b.pcm for b in want[:1]]  # the lead: uncompiled, bit for bit
    np.testing.assert_allclose(_pcm(got)[1], _pcm(want)[1], atol=1)
    # the 3-frame leads only: the regular windows and the 2-frame leads stay compiled
    assert codec.compile_leads == {14} and codec.compiled is failing


def test_compiled_lead_windows_take_graphs_up_to_the_largest_batch(program) -> None:
    short_tails = {(14, 7), (21, 7)}
    for tails in (False, True):
        on = Codec.window_limits(program, 128, tails=tails, compile_tails=True, compiled_leads=(14, 21))
        off = Codec.window_limits(program, 128, tails=tails, compile_tails=True)
        assert on[14, 0] == on[21, 0] == 128 and on[7, 0] == LEAD_MAX_BATCH  # 1 frame: uncompiled
        assert {off[r, 0] for r in LEADS} == {LEAD_MAX_BATCH}
        if tails:
            assert {on[k] for k in short_tails} == {off[k] for k in short_tails} == {LEAD_MAX_BATCH}
    assert Codec.window_limits(program, 64, compiled_leads=(14, 21))[21, 0] == 64


def test_without_a_compiled_codec_lead_windows_keep_the_lead_batch(program) -> None:
    for backend in (None, "aot_eager"):  # --codec-compile off; a compile, leads off
        codec = Codec(
            program, max_batch=4, graphs=False, compile_backend=backend, compile_leads=backend is None
        )
        assert not codec.compile_leads and not any(codec._compiles(r, 0) for r in LEADS)
    limits = Codec.window_limits(program, 128, compiled_leads=())
    assert {limits[r, 0] for r in LEADS} == {LEAD_MAX_BATCH}


def test_a_program_without_compiled_leads_keeps_them_uncompiled(program, monkeypatch) -> None:
    monkeypatch.setattr(program, "codec_compiled_leads", ())
    codec = Codec(program, max_batch=4, graphs=False, compile_backend="aot_eager", compile_leads=True)
    assert codec.compiled is not None and not codec.compile_leads
    assert codec._compiles(28, 0) and not any(codec._compiles(r, 0) for r in LEADS)


def test_the_setting_reaches_the_codec_worker() -> None:
    assert parse_role("codec_worker", ["--model", "orpheus-tiny"], {}).cfg.codec.compile_leads  # the default
    assert not parse_role(
        "codec_worker", ["--model", "orpheus-tiny", "--no-codec-compile-leads"], {}
    ).cfg.codec.compile_leads
