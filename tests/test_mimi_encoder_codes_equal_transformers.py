"""Mimi's encoder (programs/blocks/mimi_encoder.py) equals transformers' `MimiModel.encode` for the
same random weights and random codebooks: the codes exactly and the pre-quantization latent within
1e-4, for CSM's Mimi config (32 codebooks) and the Qwen3-TTS 12 Hz tokenizer's encoder config (its
first `encoder_valid_num_quantizers` = 16, cut to ceil(samples / 1920) frames as the reference's
`Qwen3TTSTokenizerV2Model.encode` does; its encoder class is a `MimiModel`). Clips of different
lengths padded into one batch get the codes each gets alone. A checkpoint in transformers' layout
loads by name. CPU fp32, clips of a second or less.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import MimiConfig, MimiModel

from programs.blocks.mimi_encoder import MimiEncoder
from programs.csm.codec import random_codebooks

ROOT = os.path.join(os.path.dirname(__file__), "..", "programs")
CSM = os.path.join(ROOT, "csm", "configs", "mimi.json")
TINY = os.path.join(ROOT, "csm", "configs", "mimi-tiny.json")  # a window of 8 of the clips' 25 steps
QWEN = os.path.join(ROOT, "qwen3_tts", "configs", "qwen3-tts-tokenizer-12hz.json")
LENGTHS = [24000, 9601, 1919, 13440]  # whole frames, a sample past a frame, under one frame, …
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(path: str) -> tuple[dict, int]:
    """(the MimiConfig-shaped dict, codebooks kept) of a shipped config."""
    with open(path) as f:
        cfg = json.load(f)
    if "encoder_config" in cfg:
        return cfg["encoder_config"], cfg["encoder_valid_num_quantizers"]
    return cfg, cfg["num_quantizers"]


def _pair(path: str, seed: int = 0) -> tuple[MimiEncoder, MimiModel, int]:
    cfg, n_q = _config(path)
    hf_cfg = {k: v for k, v in cfg.items() if k != "_frame_rate"}
    if "_frame_rate" in cfg:
        hf_cfg["frame_rate"] = cfg["_frame_rate"]
    torch.manual_seed(seed)
    ref = MimiModel(MimiConfig(**hf_cfg)).eval()
    _loud(ref)
    random_codebooks(ref)
    ours = MimiEncoder(cfg, n_q).eval()
    ours.load_weights(ref.state_dict().items())
    return ours, ref, n_q


@torch.no_grad()
def _loud(model: torch.nn.Module) -> None:
    """Weights whose every layer counts: transformers' init (std 0.02, layer scales 0.01) leaves the
    transformer's share of the latent near 1e-4, below what the test could see. Fan-in scaled
    normal weights, layer scales and norms around 1, biases around 0."""
    for name, p in model.named_parameters():
        if name.endswith("scale") or name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif p.ndim == 1:
            p.uniform_(-0.1, 0.1)
        else:
            p.normal_(0.0, p[0].numel() ** -0.5)


def _clips(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.3 * torch.randn(n, generator=gen) for n in LENGTHS]


def _batch(clips: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    audio = torch.zeros(len(clips), max(len(c) for c in clips))
    for i, c in enumerate(clips):
        audio[i, : len(c)] = c
    return audio, torch.tensor([len(c) for c in clips])


@torch.no_grad()
def _reference(ref: MimiModel, clip: torch.Tensor, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's codes [T, n_q] (T = ceil(samples / 1920)) and latent [H, T] of a lone clip."""
    x = clip[None, None]
    frames = -(-len(clip) // 1920)
    codes = ref.encode(x).audio_codes[0, :n_q, :frames].T
    latent = ref.encoder(x).latents[0, :, :frames]
    return codes, latent


@pytest.mark.parametrize("path", [CSM, QWEN, TINY], ids=["csm-mimi", "qwen3-tts-12hz", "mimi-tiny"])
def test_batched_codes_and_latents_equal_the_reference_alone(path):
    ours, ref, n_q = _pair(path)
    clips = _clips(1)
    audio, lengths = _batch(clips)
    codes, frames = ours.encode(audio, lengths)
    latent, _ = ours.latents(audio, lengths)
    assert codes.shape == (len(clips), 13, n_q) and codes.dtype == torch.int64
    for b, clip in enumerate(clips):
        want_codes, want_latent = _reference(ref, clip, n_q)
        assert int(frames[b]) == want_codes.shape[0]
        t = int(frames[b])
        assert torch.equal(codes[b, :t], want_codes), f"clip {b}: codes differ"
        assert (codes[b, t:] == 0).all()
        err = (latent[b, :, :t] - want_latent).abs().max().item()
        assert err < TOL, f"clip {b}: latent off by {err:.2e}"
        alone, n = ours.encode(clip[None], torch.tensor([len(clip)]))
        assert int(n[0]) == t and torch.equal(alone[0], codes[b, :t])
    # the codes tell clips apart: a wrong quantizer or a wrong layer would not give the same ones
    assert len({tuple(codes[b, 0].tolist()) for b in range(len(clips))}) == len(clips)
    assert codes[0, :, 1:].unique().numel() > 100


def test_without_masking_the_padding_the_last_frame_changes():
    """The masking is what keeps a padded clip's codes its own: the reference run on the padded
    batch (no lengths) gives a short clip a different last frame than alone."""
    ours, ref, n_q = _pair(CSM)
    clips = _clips(2)
    audio, lengths = _batch(clips)
    with torch.no_grad():
        padded = ref.encode(audio[:, None]).audio_codes[:, :n_q].transpose(1, 2)
    codes, frames = ours.encode(audio, lengths)
    b = 1  # 9601 samples: its last frame's window reaches into the padding
    t = int(frames[b])
    assert torch.equal(padded[b, : t - 1], codes[b, : t - 1])
    assert not torch.equal(padded[b, t - 1], codes[b, t - 1])


def test_a_transformers_checkpoint_loads_by_name(tmp_path):
    """`from_pretrained` reads a Mimi checkpoint folder (config.json and safetensors as
    `MimiModel.save_pretrained` writes them) and a Qwen3-TTS tokenizer folder (`encoder.*`)."""
    ours, ref, n_q = _pair(TINY, seed=3)
    ref.save_pretrained(tmp_path / "mimi")
    loaded = MimiEncoder.from_pretrained(str(tmp_path / "mimi"), torch.float32, "cpu")
    clip = _clips(4)[0][:4000]
    want, _ = _reference(ref, clip, n_q)
    got, _ = loaded.encode(clip[None], torch.tensor([len(clip)]))
    assert torch.equal(got[0], want)

    from safetensors.torch import save_file

    with open(os.path.join(ROOT, "qwen3_tts", "configs", "qwen3-tts-tokenizer-tiny.json")) as f:
        tok = json.load(f)
    qdir = tmp_path / "tokenizer"
    qdir.mkdir()
    (qdir / "config.json").write_text(json.dumps(tok))
    state = {f"encoder.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    state["decoder.pre_conv.conv.weight"] = torch.zeros(1)  # the decoder's weights are passed over
    save_file(state, str(qdir / "model.safetensors"))
    qwen = MimiEncoder.from_pretrained(str(qdir), torch.float32, "cpu")
    assert qwen.n_q == 16
    got, _ = qwen.encode(clip[None], torch.tensor([len(clip)]))
    assert torch.equal(got[0], want[:, :16])
