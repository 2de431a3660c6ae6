"""transformers' Higgs Audio v2 (the reference) built from the shipped configs with the weights of
our programs, for the parity tests: the LM (`HiggsAudioV2ForConditionalGeneration`) and the
tokenizer's decode (`HiggsAudioV2TokenizerModel.decode`).

The tokenizer's module imports torchaudio for the resampling its encoder does; the decoder never
calls it, and the venv has no torchaudio, so `reference_tokenizer` registers an empty module under
that name before importing it."""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import sys
import types

import torch


def reference_lm(lm, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """HiggsAudioV2ForConditionalGeneration with the config and weights of `lm` (a HiggsLM), built
    on `device` in `dtype`."""
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    cfg = {k: v for k, v in lm.config.items() if k not in ("architectures", "model_type")}
    with torch.device(device):
        ref = HiggsAudioV2ForConditionalGeneration._from_config(HiggsAudioV2Config(**cfg), dtype=dtype).eval()
    missing, unexpected = ref.load_state_dict(lm.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return ref


@contextlib.contextmanager
def repetition_aware(ref, seeds: list[int]):
    """`ref.generate` with the published repetition-aware sampling (generation_config.json's
    `ras_win_len` 7, `ras_win_max_num_repeat` 2) and its redraws made the program's: the reference
    redraws the repeated codebooks with `Tensor.multinomial` of their raw logits' softmax, here the
    draw the runtime's `untempered` sampler makes for request b (`seeds[b]`), codebook k (salt
    RAS_SALT + k) at generated row t (its counter). The rows a redraw is for are told apart by
    their softmax, matched against the last forward pass's raw logits."""
    from unittest import mock

    from gpu_worker.runner.sampler import SamplingRows, depth_sampler
    from programs.higgs_tts import spec as h

    gc = ref.generation_config
    before = (getattr(gc, "ras_win_len", None), getattr(gc, "ras_win_max_num_repeat", None))
    gc.ras_win_len, gc.ras_win_max_num_repeat = h.RAS_WINDOW, h.RAS_MAX_REPEAT
    seen = {"t": -1, "raw": None, "redraws": 0}  # yielded: the redraws made
    forward = ref.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen["t"] += 1  # the prefill's pass generates row 0
        seen["raw"] = out.logits[:, -1].float().reshape(out.logits.shape[0], h.N_CODEBOOKS, -1)
        return out

    def draw(logits: torch.Tensor, seed: int, k: int, t: int) -> int:
        one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)  # noqa: E731
        rows = SamplingRows(
            one(1.0), one(0, torch.int64), one(1.0), one(0.0), one(1.0), one(seed, torch.int64),
            one(t, torch.int64), None, one(False, torch.bool),
        )  # fmt: skip
        return int(depth_sampler(rows).untempered(logits[None, None], h.RAS_SALT + k)[0, 0])

    def multinomial(probs: torch.Tensor, num_samples: int, replacement: bool = False, **kw) -> torch.Tensor:
        raw = seen["raw"]
        soft = raw.softmax(dim=-1).reshape(-1, raw.shape[-1])  # [B * 8, V]
        picks = []
        for p in probs:
            b, k = divmod(int((soft - p).abs().amax(dim=-1).argmin()), h.N_CODEBOOKS)
            picks.append(draw(raw[b, k], seeds[b], k, seen["t"]))
        seen["redraws"] += len(picks)
        return torch.tensor(picks, dtype=torch.int64).reshape(-1, 1)

    try:
        with (
            mock.patch.object(ref, "forward", spy),
            mock.patch.object(torch.Tensor, "multinomial", multinomial),
        ):
            yield seen
    finally:
        gc.ras_win_len, gc.ras_win_max_num_repeat = before


def reference_tokenizer(codec, config_path: str) -> torch.nn.Module:
    """HiggsAudioV2TokenizerModel of the config at `config_path` with `codec`'s decoder weights."""
    if "torchaudio" not in sys.modules:
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        stub.__version__ = "0.0"
        sys.modules["torchaudio"] = stub
    from transformers import HiggsAudioV2TokenizerConfig
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    with open(config_path) as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    ref = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**cfg)).eval()
    state = {k: v for k, v in codec.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    return ref
