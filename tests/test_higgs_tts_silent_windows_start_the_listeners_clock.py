"""Higgs Audio v2's first windows yield no audio (the delay pattern's lead-in, then the decoder's
look-ahead): the codec's first valid window is window `detok_silent` of a stream. The gpu_worker
lets those silent windows wait for a codec pass about until the first audible one comes (nothing
counted as sent), holds the first `detok_first_windows` audible windows to send them together, and
starts the listener's clock as they leave, so the slack it stamps on later windows is the audio
actually in the listener's hands."""

from __future__ import annotations

import numpy as np
import torch

from common.messages import SamplingParams
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.request import Request
from gpu_worker.windows import AudioWindows
from programs import get_spec, load_program_class
from programs.higgs_tts.codec import HiggsCodec
from tests.test_higgs_tts_codec_stream import rows_of


def test_the_first_valid_window_is_window_detok_silent() -> None:
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    codec = HiggsCodec.from_config(p.config_path("codec_config"), torch.float32, "cpu")
    codec.init_streams(2)
    frames = torch.randint(0, 1024, (6, 8), generator=torch.Generator().manual_seed(0))
    rows = rows_of(frames, p.flush_rows)
    valid = []
    for t, row in enumerate(rows):
        _, ok = codec.decode_stream(row[None, None], torch.tensor([0]), torch.tensor([t == 0]))
        valid.append(bool(ok.all()))
    assert p.detok_silent > 0
    assert valid.index(True) == p.detok_silent
    assert sum(valid) == len(frames)


def _stream(p, rows: int, now: list[float]) -> tuple[AudioWindows, Request, list[list]]:
    """`rows` audio rows of one request, a row every 10 ms: the windows out after each row."""
    clock = StepClock(p.rows_per_second, 8)
    for _ in range(3):
        clock.record(1, 0.010)  # steps of 10 ms
    windows = AudioWindows(p, "adaptive", clock, now=lambda: now[0])
    req = Request("r", np.zeros((4, 8), np.int64), SamplingParams(max_tokens=64), 0.0, 80)
    req.audio = np.zeros((80, 8), np.int32)
    outs = []
    for n in range(1, rows + 1):
        req.n_audio = n
        now[0] += 0.010
        out: list = []
        windows.after_row(req, out)
        outs.append(out)
    return windows, req, outs


def test_silent_windows_go_at_once_and_the_clock_starts_after_them() -> None:
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    k, silent = p.detok_first_windows, p.detok_silent
    assert k > 1
    now = [100.0]
    _, req, outs = _stream(p, silent + k + 2, now)
    frame_s = p.detok_samples / p.sample_rate
    # a silent window goes at its own row and may wait about until the first audible one comes
    assert all(len(o) == 1 for o in outs[:silent])
    waits = [o[0].slack_ms for o in outs[:silent]]
    assert waits == [10.0 * (silent - j) for j in range(silent)]
    # the first k audible windows are held, then go together, with no slack, in order
    assert all(o == [] for o in outs[silent : silent + k - 1])
    group = outs[silent + k - 1]
    assert [c.index for c in group] == list(range(silent, silent + k))
    assert all(c.slack_ms == 0 for c in group)
    assert abs(req.t_first - (100.0 + 0.010 * (silent + k))) < 1e-9  # the clock starts as they leave
    after = [c for o in outs[silent + k :] for c in o]
    assert len(after) == 2 and abs(req.sent_s - (k + 2) * frame_s) < 1e-9
    # k frames sent, 10 ms played: the next window's listener holds k frames less 10 ms
    assert abs(after[0].slack_ms - 1000 * (k * frame_s - 0.010)) < 1e-6


def test_a_stream_that_ends_with_windows_held_sends_them_at_its_end() -> None:
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    silent = p.detok_silent
    windows, req, outs = _stream(p, silent + 2, [0.0])
    assert outs[-2:] == [[], []]
    out: list = []
    windows.flush(req, out)
    assert [c.index for c in out] == [silent, silent + 1] and req.held == []
