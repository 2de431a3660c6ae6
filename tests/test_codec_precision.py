"""The codec's precision option (`--codec-dtype`): bfloat16 and float16 decodes stay close to
float32, measured as SNR over a window's kept samples. Random weights, on CPU; the bounds sit a
few dB under what was measured (24 kHz architecture: bf16 39 dB, fp16 58 dB; tiny: bf16 41 dB,
fp16 60 dB). float16 runs on the tiny architecture only: CPU float16 convolutions are too slow
for the real one in a unit test. The flag reaches the program as `codec_dtype`."""

from __future__ import annotations

import os

import pytest
import torch

from common.config import CodecSettings, ServeConfig, program_kwargs
from programs import get_spec, load_program_class
from programs.orpheus.codec import SnacCodec

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "orpheus", "configs")


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 10 * torch.log10(ref.pow(2).sum(-1) / (x.float() - ref).pow(2).sum(-1))


@pytest.mark.parametrize(
    ("config", "dtype", "min_db"),
    [
        ("snac_24khz.json", torch.bfloat16, 35.0),
        ("snac-tiny.json", torch.bfloat16, 37.0),
        ("snac-tiny.json", torch.float16, 55.0),
    ],
)
def test_half_precision_codec_snr_against_float32(config, dtype, min_db) -> None:
    codes = torch.randint(0, 4096, (2, 28), generator=torch.Generator().manual_seed(0))
    tokens = (128266 + 4096 * (torch.arange(28) % 7) + codes)[:, :, None]
    keys = torch.tensor([3, 4])
    path = os.path.join(CONFIGS, config)
    ref, _ = SnacCodec.from_config(path).decode_orpheus_window(tokens, keys)
    audio, valid = SnacCodec.from_config(path, dtype=dtype).decode_orpheus_window(tokens, keys)
    assert audio.dtype == torch.float32 and valid.all()
    snr = snr_db(audio, ref)
    assert snr.min() > min_db and snr.max() < 90  # close to fp32, and really in the lower precision


def test_codec_dtype_setting_reaches_the_program() -> None:
    spec = get_spec("orpheus-tiny")
    cls = load_program_class("orpheus-tiny")
    assert cls(spec, **program_kwargs(ServeConfig())).codec_dtype == torch.float32  # auto: the model's
    assert (
        cls(spec, **program_kwargs(ServeConfig(codec=CodecSettings(dtype="bfloat16")))).codec_dtype
        == torch.bfloat16
    )
    with pytest.raises(ValueError, match="codec_dtype"):
        cls(spec, codec_dtype="int8")
