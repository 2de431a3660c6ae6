"""SNAC 24 kHz codec for Orpheus, with the reference windowing and per-request noise.

Based on the `snac` package (hubertsiuzdak/snac: `SNAC.decode`, `NoiseBlock`) and on the Orpheus
reference decoder (canopyai/Orpheus-TTS `decoder.py`, `convert_to_audio`): a 28-token window
(4 frames of 7 tokens) is split into SNAC's three levels, decoded, and samples [2048:4096] kept.

Two changes make it servable, both confined to our SNAC instance:
- each decoder `NoiseBlock` draws its noise from `programs.rng` keyed per batch entry instead of
  the global `torch.randn`, so a request's audio depends on its seed only, never on its batch,
  and the draw is capturable in a CUDA graph;
- weight norm is folded into plain weights once at load (the same values SNAC recomputes on
  every forward), which removes two kernels per convolution from every decode.

Window validity: the reference drops a window when any code is < 0 or > 4096. A code of exactly
4096 passes that check and then indexes past SNAC's 4096-entry codebook (a crash in the
reference); here it marks the window invalid too, so valid means every code is in [0, 4096).
Invalid windows still decode (codes clamped into range) so a batch never faults; the caller
drops their audio.

On CUDA, cuDNN's TF32 convolutions (on by default in torch) move fp32 audio by ~5e-4 and make it
depend on the batch size (measured on an H200); with `torch.backends.cudnn.allow_tf32 = False`
GPU fp32 matched CPU within 1e-6 and a window decoded alone equalled it inside a batch bit for bit.
"""

from __future__ import annotations

import json
import types
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from programs import rng
from programs.orpheus.spec import AUDIO_BASE, CODEBOOK, FRAME

WINDOW_FRAMES = 4  # frames per decoded window
WINDOW = WINDOW_FRAMES * FRAME  # 28 tokens
KEEP = (2048, 4096)  # samples of the window's audio the reference keeps


def _level_order() -> list[int]:
    """Row indices of a window, regrouped level by level: level 0 ← frame slot 0, level 1 ← slots
    1 and 4, level 2 ← slots 2, 3, 5, 6, frames in time order within each level."""
    order = [7 * j for j in range(WINDOW_FRAMES)]
    order += [7 * j + s for j in range(WINDOW_FRAMES) for s in (1, 4)]
    order += [7 * j + s for j in range(WINDOW_FRAMES) for s in (2, 3, 5, 6)]
    return order


class SnacCodec:
    """A SNAC model ready for graph capture: `decode_orpheus_window(tokens, keys)`.

    Takes ownership of `snac`: its weight norm is folded in place, and torch keeps a parametrized
    module's class shared with its deepcopies, so do not hand it a deepcopy of a model still in use.
    """

    def __init__(
        self, snac: nn.Module, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        from snac.layers import NoiseBlock

        self.device = torch.device(device)
        self.dtype = dtype
        for module in snac.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        self.snac = snac.to(device=self.device, dtype=dtype).eval()
        self.codebook_size: int = snac.codebook_size
        # Per-entry noise keys of the current decode [Bd] int64; set before every forward.
        self._keys = torch.zeros(1, dtype=torch.int64, device=self.device)
        blocks = [m for m in self.snac.decoder.modules() if isinstance(m, NoiseBlock)]
        self._block_ids = torch.arange(len(blocks), dtype=torch.int64, device=self.device)  # [blocks]
        for index, block in enumerate(blocks):
            block.forward = types.MethodType(self._keyed_noise_forward(index), block)
        self.num_noise_blocks = len(blocks)
        self._order = torch.tensor(_level_order(), dtype=torch.int64, device=self.device)  # [28]
        slot = torch.arange(WINDOW, dtype=torch.int64, device=self.device) % FRAME
        self._offset = AUDIO_BASE + CODEBOOK * slot  # [28] int64: token id of code 0 per row

    def _keyed_noise_forward(self, index: int):
        codec = self

        def forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:  # x [B, C, T]
            # The block index goes in as a device scalar: a Python int would be copied host → device
            # inside rng.mix_keys, which CUDA graph capture forbids.
            keys = rng.mix_keys(codec._keys, codec._block_ids[index])  # [B]: one stream per entry and block
            noise = rng.normal(keys, x.shape[-1]).to(x.dtype)[:, None, :]  # [B, 1, T]
            return x + noise * block.linear(x)

        return forward

    # --- construction ----------------------------------------------------------------------------
    @staticmethod
    def dummy_snac(config: dict[str, Any] | str, seed: int = 0) -> nn.Module:
        """An unmodified `snac.SNAC` with random weights, deterministic for `seed` (built on CPU
        under a forked RNG so the global generator is left untouched)."""
        from snac import SNAC

        if isinstance(config, str):
            with open(config) as f:
                config = json.load(f)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return SNAC(**config).eval()

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any] | str,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> SnacCodec:
        return cls(cls.dummy_snac(config, seed), dtype, device)

    @classmethod
    def from_pretrained(
        cls, id_or_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> SnacCodec:
        from snac import SNAC

        # SNAC reads config.json + pytorch_model.bin from a local dir or downloads them from the hub.
        return cls(SNAC.from_pretrained(id_or_dir), dtype, device)

    # --- decoding (graph-safe) -------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: the runtime may write into the outputs later
    def decode_codes(self, codes: list[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        """SNAC levels [Bd, T0], [Bd, 2*T0], [Bd, 4*T0] int64, keys [Bd] int64 → audio [Bd, 1, S]."""
        # A captured graph keeps reading the keys tensor it was captured with: replay it after
        # copying new keys into that same (static) tensor.
        self._keys = keys
        return self.snac.decode(codes)

    @torch.no_grad()
    def decode_orpheus_window(
        self, tokens: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [Bd, 28, 1] int64 (token ids), keys [Bd] int64 → audio [Bd, 2048] float32,
        valid [Bd] bool."""
        codes = tokens[:, :, 0] - self._offset  # [Bd, 28] SNAC codes, frame-slot offset removed
        valid = ((codes >= 0) & (codes < self.codebook_size)).all(dim=1)  # [Bd] bool
        # Out-of-range codes would index past the codebook; clamp so invalid windows decode
        # harmlessly (their audio is dropped). Valid windows are unchanged by the clamp.
        codes = codes.clamp(0, self.codebook_size - 1)[:, self._order]  # [Bd, 28] level-major
        n0 = WINDOW_FRAMES
        levels = [codes[:, :n0], codes[:, n0 : 3 * n0], codes[:, 3 * n0 :]]  # [Bd, 4], [Bd, 8], [Bd, 16]
        audio = self.decode_codes(levels, keys)  # [Bd, 1, 8192]
        return audio[:, 0, KEEP[0] : KEEP[1]].float(), valid
