"""Qwen3-TTS Base's speaker encoder (programs/qwen3_tts/speaker.py) equals the reference's
`Qwen3TTSSpeakerEncoder` on the reference's `mel_spectrogram` features (qwen-tts-compat) for the same
random weights, within 1e-4, with the published Base configs' speaker encoder (the 1.7B's 2048-wide
x-vectors, the 0.6B's 1024): clips of different lengths, one batch, each as the reference encodes
it alone. The mel filterbank is librosa's. CPU fp32. Skips where the reference is missing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from programs.qwen3_tts.speaker import SpeakerEncoder, mel_filters
from tests.qwen3_tts_reference import reference_module

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs")
LENGTHS = [24000, 9601, 3000]
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_mel_filterbank_is_librosas():
    librosa = pytest.importorskip("librosa")
    want = librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    np.testing.assert_allclose(mel_filters(24000, 1024, 128, 0.0, 12000), want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["qwen3-tts-12hz-1.7b-base.json", "qwen3-tts-12hz-0.6b-base.json"])
def test_batched_x_vectors_equal_the_reference_alone(name):
    mod = reference_module()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    with open(os.path.join(CONFIGS, name)) as f:
        cfg = json.load(f)["speaker_encoder_config"]
    torch.manual_seed(0)
    ref = mod.Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**cfg)).eval()
    with torch.no_grad():  # fan-in scaled, so that every layer moves the output
        for _, p in ref.named_parameters():
            p.normal_(0.0, p[0].numel() ** -0.5 if p.ndim > 1 else 0.1)
    ours = SpeakerEncoder(cfg).eval()
    loaded = ours.load_weights(("speaker_encoder." + k, v) for k, v in ref.state_dict().items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    t = torch.arange(max(LENGTHS)) / 24000
    clips = [
        (0.3 * torch.sin(2 * np.pi * (110 + 70 * i) * t[:n]) + 0.05 * torch.randn(n, generator=gen)).clamp(
            -1, 1
        )
        for i, n in enumerate(LENGTHS)
    ]
    audio = torch.zeros(len(clips), max(LENGTHS))
    for i, c in enumerate(clips):
        audio[i, : len(c)] = c
    got = ours.embed(audio, torch.tensor(LENGTHS))
    assert got.shape == (len(clips), cfg["enc_dim"])
    for i, clip in enumerate(clips):
        with torch.no_grad():
            mels = mod.mel_spectrogram(
                clip[None],
                n_fft=1024,
                num_mels=128,
                sampling_rate=24000,
                hop_size=256,
                win_size=1024,
                fmin=0,
                fmax=12000,
            )
            want = ref(mels.transpose(1, 2))[0]
        err = (got[i] - want).abs().max().item()
        assert err < TOL, f"clip {i}: off by {err:.2e}"
    assert (got[0] - got[1]).abs().max() > 100 * TOL, "the clips give different x-vectors"
