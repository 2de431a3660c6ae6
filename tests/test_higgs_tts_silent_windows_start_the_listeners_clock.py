"""Higgs Audio v2's first windows yield no audio (the delay pattern's lead-in, then the decoder's
look-ahead): the codec's first valid window is window `detok_silent` of a stream. The gpu_worker
lets those silent windows wait for a codec pass about until the first audible one comes (nothing
counted as sent) and starts the listener's clock at the first window with audio, so the slack it
stamps on later windows is the audio actually in the listener's hands."""

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


def test_silent_windows_go_at_once_and_the_clock_starts_after_them() -> None:
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    now = [100.0]
    clock = StepClock(p.rows_per_second, 8)
    for _ in range(3):
        clock.record(1, 0.010)  # steps of 10 ms
    windows = AudioWindows(p, "adaptive", clock, now=lambda: now[0])
    req = Request("r", np.zeros((4, 8), np.int64), SamplingParams(max_tokens=64), 0.0, 80)
    req.audio = np.zeros((80, 8), np.int32)
    frame_s = p.detok_samples / p.sample_rate
    chunks = []
    for n in range(1, p.detok_silent + 4):
        req.n_audio = n
        now[0] += 0.010  # a row every 10 ms
        chunks.append(windows.after_row(req))
    assert all(c is not None for c in chunks)
    silent, audible = chunks[: p.detok_silent], chunks[p.detok_silent :]
    # a silent window may wait about until the first audible one comes: less for later ones
    waits = [c.slack_ms for c in silent]
    assert waits == [10.0 * (p.detok_silent - k) for k in range(p.detok_silent)]
    assert audible[0].slack_ms == 0  # the first audio goes at once
    assert abs(req.t_first - (100.0 + 0.010 * (p.detok_silent + 1))) < 1e-9  # the first audible window left
    assert abs(req.sent_s - 3 * frame_s) < 1e-9  # three audible windows so far
    # one frame sent, 10 ms played: the second audible window's listener holds 30 ms
    assert abs(audible[1].slack_ms - 1000 * (frame_s - 0.010)) < 1e-6
