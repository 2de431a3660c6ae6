"""Higgs Audio v2's clip encoder (programs/higgs_tts/encoder.py) against the reference's
`HiggsAudioV2TokenizerModel.encode` with the same random weights (random codebooks): equal codes for
clips of 1-5 s of the tiny tokenizer config, and of a clip whose length needs the acoustic
encoder's padding; checkpoint names in transformers' layout (HuBERT's weight-normed positional
convolution) load into the same encoder.

The reference resamples to HuBERT's 16 kHz with torchaudio, which the venv lacks: where torchaudio
is missing, its `functional.resample` is supplied by `torchaudio_resample` below, torchaudio's
windowed-sinc resampler (torchaudio/functional/functional.py: `resample`,
`_get_sinc_resample_kernel`, `_apply_sinc_resample_kernel`, Hann window) as it is there."""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from programs.higgs_tts.codec import fold_weight_norm
from programs.higgs_tts.encoder import HiggsEncoder, resample

CONFIG = os.path.join(os.path.dirname(__file__), "..", "programs", "higgs_tts", "configs")
TINY = os.path.join(CONFIG, "higgs-audio-v2-tokenizer-tiny.json")


def torchaudio_resample(waveform, orig_freq, new_freq, lowpass_filter_width=6, rolloff=0.99, **_):
    """torchaudio.functional.resample (sinc_interp_hann), transcribed."""
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    dtype, device = waveform.dtype, waveform.device
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    shape = waveform.size()
    waveform = waveform.view(-1, shape[-1])
    num_wavs, length = waveform.shape
    waveform = torch.nn.functional.pad(waveform, (width, width + orig))
    resampled = torch.nn.functional.conv1d(waveform[:, None], kernels, stride=orig)
    resampled = resampled.transpose(1, 2).reshape(num_wavs, -1)
    target_length = torch.ceil(torch.as_tensor(new * length / orig)).long()
    resampled = resampled[..., :target_length]
    return resampled.view(shape[:-1] + resampled.shape[-1:])


def _torchaudio() -> types.ModuleType:
    if "torchaudio" not in sys.modules:
        try:
            import torchaudio  # noqa: F401
        except ImportError:
            stub = types.ModuleType("torchaudio")
            stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
            stub.__version__ = "0.0"
            sys.modules["torchaudio"] = stub
    mod = sys.modules["torchaudio"]
    if not hasattr(mod, "functional"):
        mod.functional = types.SimpleNamespace(resample=torchaudio_resample)
    return mod


def reference_encoder(encoder: HiggsEncoder, config_path: str) -> torch.nn.Module:
    """HiggsAudioV2TokenizerModel of the config with `encoder`'s weights (HuBERT's positional
    convolution through its weight norm: g = ‖w‖ over the kernel's other dims, v = w)."""
    _torchaudio()
    from transformers import HiggsAudioV2TokenizerConfig
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    with open(config_path) as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    ref = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**cfg)).eval()
    state = as_checkpoint(encoder)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    ours = {n.split(".")[0] for n in state}
    unused = ("masked_spec_embed", "inited", "cluster_size", "embed_avg")  # training-only state
    left = [m for m in missing if m.split(".")[0] in ours and not m.endswith(unused)]
    assert not left, left
    return ref


def as_checkpoint(encoder: HiggsEncoder) -> dict[str, torch.Tensor]:
    """`encoder`'s weights under the checkpoint's names: HuBERT's positional conv weight-normed."""
    state = dict(encoder.state_dict())
    w = state.pop("semantic_model.encoder.pos_conv_embed.conv.weight")
    base = "semantic_model.encoder.pos_conv_embed.conv.parametrizations.weight."
    state[base + "original0"] = w.pow(2).sum(dim=(0, 1), keepdim=True).sqrt()
    state[base + "original1"] = w
    return state


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    encoder = HiggsEncoder.from_config(TINY, torch.float32, "cpu", seed=3)
    return encoder, reference_encoder(encoder, TINY)


def _clip(seconds: float, seed: int, rate: int = 24000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(seconds * rate)
    t = torch.arange(n) / rate
    tone = 0.3 * torch.sin(2 * math.pi * (120 + 40 * seed) * t) * torch.sin(2 * math.pi * 3 * t)
    return (tone + 0.05 * torch.randn(n, generator=gen)).float()


def test_resample_is_torchaudios():
    x = _clip(1.3, 7)
    assert torch.equal(resample(x, 24000, 16000), torchaudio_resample(x, 24000, 16000))


@pytest.mark.parametrize("seconds", [1.0, 2.37, 3.0, 5.0, 4.01])
def test_codes_equal_the_reference_encode(pair, seconds):
    encoder, ref = pair
    clip = _clip(seconds, int(seconds * 10))
    ours = encoder.encode(clip)
    with torch.no_grad():
        theirs = ref.encode(clip[None, None], return_dict=False)[0].t()  # [T, 8]
    assert ours.shape == theirs.shape and ours.shape[1] == 8
    assert ours.shape[0] == math.ceil(len(clip) / 960)
    assert len(set(ours[:, 0].tolist())) > 1  # the codes tell the frames apart
    assert torch.equal(ours, theirs)


def test_checkpoint_names_load(pair):
    encoder, _ = pair
    state = as_checkpoint(encoder)
    loaded = HiggsEncoder(json.load(open(TINY)))
    folded = fold_weight_norm(state)
    loaded.load_state_dict(folded)
    clip = _clip(2.0, 5)
    assert torch.equal(loaded.eval().encode(clip), encoder.encode(clip))
    np.testing.assert_allclose(
        folded["semantic_model.encoder.pos_conv_embed.conv.weight"],
        encoder.state_dict()["semantic_model.encoder.pos_conv_embed.conv.weight"],
        rtol=1e-6,
        atol=1e-7,
    )
