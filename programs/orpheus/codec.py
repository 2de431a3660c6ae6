"""SNAC 24 kHz codec for Orpheus, with the reference windowing and per-request noise.

Based on the `snac` package (hubertsiuzdak/snac: `SNAC.decode`, `NoiseBlock`) and on the Orpheus
reference decoder (canopyai/Orpheus-TTS `decoder.py`, `convert_to_audio`): a 28-token window
(4 frames of 7 tokens) is split into SNAC's three levels, decoded, and samples [2048:4096] kept.

Three changes make it servable, all confined to our SNAC instance:
- each decoder `NoiseBlock` draws its noise from `programs.blocks.rng` keyed per batch entry instead of
  the global `torch.randn`, so a request's audio depends on its seed only, never on its batch,
  and the draw is capturable in a CUDA graph;
- weight norm is folded into plain weights once at load (the same values SNAC recomputes on
  every forward), which removes two kernels per convolution from every decode;
- a window decodes cropped (`crop=True`, the default): each decoder stage computes only the
  positions the kept samples [2048:4096] depend on (programs/orpheus/snac_crop.py), with the
  full decode's zero padding at the window's edges and its noise at the same positions, so the
  audio equals the full-window decode (`crop=False`) to float rounding (< 1e-6 on CPU) for 0.39x
  its convolution work (1656 → 651 M multiply-accumulates per window for SNAC 24 kHz).

Lead windows (a request's first 1-3 frames, for a fast first chunk) decode as a SNAC window of
those frames and keep all of it: L frames → L * 2048 samples.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from programs.blocks import rng
from programs.orpheus.snac_crop import CroppedDecoder, normal_at
from programs.orpheus.spec import AUDIO_BASE, CODEBOOK, FRAME

WINDOW_FRAMES = 4  # frames per decoded window
WINDOW = WINDOW_FRAMES * FRAME  # 28 tokens
KEEP = (2048, 4096)  # samples of the window's audio the reference keeps
SAMPLES_PER_FRAME = 2048  # SNAC 24 kHz: one Orpheus frame decodes to 2048 samples
# Inductor inlines a pointwise value into each of its readers unless it reads more than 4 inputs:
# a Snake read by a depthwise convolution's 7 taps would be computed (its sine included) 7 times
# per output. Realizing every value read more than once: 0.72x the compiled decode's time on the
# H200 (bench/results/h200-snac-codec-compiled.json).
REALIZE_REUSED = {"realize_reads_threshold": 1}
LEAD_ROWS = (7, 14, 21)  # lead windows: the first 1-3 frames of a request, decoded whole


def _level_order(frames: int = WINDOW_FRAMES) -> list[int]:
    """Row indices of a window of `frames` frames, regrouped level by level: level 0 ← frame slot
    0, level 1 ← slots 1 and 4, level 2 ← slots 2, 3, 5, 6, frames in time order within each level."""
    order = [7 * j for j in range(frames)]
    order += [7 * j + s for j in range(frames) for s in (1, 4)]
    order += [7 * j + s for j in range(frames) for s in (2, 3, 5, 6)]
    return order


class SnacCodec:
    """A SNAC model ready for graph capture: `decode_orpheus_window(tokens, keys)`.

    Takes ownership of `snac`: its weight norm is folded in place, and torch keeps a parametrized
    module's class shared with its deepcopies, so do not hand it a deepcopy of a model still in use.
    """

    def __init__(
        self,
        snac: nn.Module,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        crop: bool = True,
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
        try:
            self.cropped: CroppedDecoder | None = CroppedDecoder(self.snac.decoder, self._noise_at)
            # The same decode with depthwise convolutions as shifted sums, for torch.compile.
            self.cropped_taps: CroppedDecoder | None = CroppedDecoder(
                self.snac.decoder, self._noise_at, taps=True
            )
        except NotImplementedError:  # a decoder with local attention: only the full decode
            self.cropped = self.cropped_taps = None
        # Decode only what the kept samples depend on (exact; see snac_crop.py) unless False.
        self.crop = crop and self.cropped is not None
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rows in (*LEAD_ROWS, WINDOW):
            order = torch.tensor(_level_order(rows // FRAME), dtype=torch.int64, device=self.device)
            slot = torch.arange(rows, dtype=torch.int64, device=self.device) % FRAME
            # [rows] level-major row order, [rows] token id of code 0 per row
            self._layouts[rows] = order, AUDIO_BASE + CODEBOOK * slot

    def _keyed_noise_forward(self, index: int):
        codec = self

        def forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:  # x [B, C, T]
            # The block index goes in as a device scalar: a Python int would be copied host → device
            # inside rng.mix_keys, which CUDA graph capture forbids.
            keys = rng.mix_keys(codec._keys, codec._block_ids[index])  # [B]: one stream per entry and block
            noise = rng.normal(keys, x.shape[-1]).to(x.dtype)[:, None, :]  # [B, 1, T]
            return x + noise * block.linear(x)

        return forward

    def _noise_at(self, block: int, start: int, n: int) -> torch.Tensor:
        """The noise `_keyed_noise_forward` draws for `block`, at positions [start, start + n)."""
        return normal_at(rng.mix_keys(self._keys, self._block_ids[block]), start, n)  # [B, n]

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
        crop: bool = True,
    ) -> SnacCodec:
        return cls(cls.dummy_snac(config, seed), dtype, device, crop)

    @classmethod
    def from_pretrained(
        cls,
        id_or_dir: str,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        crop: bool = True,
    ) -> SnacCodec:
        from snac import SNAC

        # SNAC reads config.json + pytorch_model.bin from a local dir or downloads them from the hub.
        return cls(SNAC.from_pretrained(id_or_dir), dtype, device, crop)

    # --- decoding (graph-safe) -------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: the runtime may write into the outputs later
    def decode_codes(
        self,
        codes: list[torch.Tensor],
        keys: torch.Tensor,
        keep: tuple[int, int] | None = None,
        crop: bool | None = None,
        taps: bool = False,
    ) -> torch.Tensor:
        """SNAC levels [Bd, T0], [Bd, 2*T0], [Bd, 4*T0] int64, keys [Bd] int64 → audio samples
        `keep` (default all) [Bd, 1, S]. `crop` (default `self.crop`) computes only what those
        samples depend on; False decodes the whole window and slices. `taps`: the cropped decode
        with depthwise convolutions as shifted sums (for `compiled`)."""
        # A captured graph keeps reading the keys tensor it was captured with: replay it after
        # copying new keys into that same (static) tensor.
        self._keys = keys
        if not (self.crop if crop is None else crop) or self.cropped is None:
            audio = self.snac.decode(codes)  # [Bd, 1, S]
            return audio if keep is None else audio[..., keep[0] : keep[1]]
        z = self.snac.quantizer.from_codes(codes)  # [Bd, latent, 4*T0]: a few positions, kept whole
        t = z.shape[-1]
        keep = keep or (0, self.cropped.out_length(t))
        lo, hi = self.cropped.input_interval(t, keep)
        cropped = self.cropped_taps if taps else self.cropped
        return cropped(z[..., lo:hi], keep, lo, t)

    def window_levels(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """tokens [Bd, R, 1] int64 (R = 28 or a lead size) → SNAC levels [Bd, L], [Bd, 2L], [Bd, 4L]
        int64 (L = R / 7 frames), valid [Bd] bool (every code in [0, 4096))."""
        rows = tokens.shape[1]
        if rows not in self._layouts:
            raise ValueError(f"a window has {WINDOW} rows or a lead window {LEAD_ROWS}; got {rows}")
        order, offset = self._layouts[rows]
        codes = tokens[:, :, 0] - offset  # [Bd, R] SNAC codes, frame-slot offset removed
        valid = ((codes >= 0) & (codes < self.codebook_size)).all(dim=1)  # [Bd] bool
        # Out-of-range codes would index past the codebook; clamp so invalid windows decode
        # harmlessly (their audio is dropped). Valid windows are unchanged by the clamp.
        codes = codes.clamp(0, self.codebook_size - 1)[:, order]  # [Bd, R] level-major
        n0 = rows // FRAME
        levels = [codes[:, :n0], codes[:, n0 : 3 * n0], codes[:, 3 * n0 :]]  # [Bd, L], [Bd, 2L], [Bd, 4L]
        return levels, valid

    @torch.no_grad()
    def decode_orpheus_window(
        self,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        crop: bool | None = None,
        tail_rows: int = 0,
        taps: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [Bd, R, 1] int64 (token ids), keys [Bd] int64 → audio [Bd, S] float32, valid [Bd]
        bool. R = 28: a window, S = 2048 (its samples [2048:4096]); R = 7, 14, 21: a lead window of
        L = R / 7 frames decoded as one SNAC window, S = L * 2048 (all of it). `tail_rows` (a
        multiple of 7): the window of R / 7 frames decoded whole, keeping only its last
        tail_rows / 7 frames' samples."""
        levels, valid = self.window_levels(tokens)
        keep = KEEP if tokens.shape[1] == WINDOW else None
        if tail_rows:
            total = tokens.shape[1] // FRAME * SAMPLES_PER_FRAME
            keep = (total - tail_rows // FRAME * SAMPLES_PER_FRAME, total)
        audio = self.decode_codes(levels, keys, keep, crop, taps)  # [Bd, 1, S]
        return audio[:, 0].float(), valid

    def compiled(
        self, backend: str = "inductor", options: dict | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`decode_orpheus_window` of regular windows, of tail windows of a regular window's rows
        (`tail_rows`: a progressive stream's newest frame) and of lead windows (`LEAD_ROWS`, decoded
        whole: a request's first chunk), under `torch.compile`, its batch dimension dynamic (one
        compile per kind serves every batch size; size 1 gets its own). The compiler fuses every
        Snake, noise draw, residual add and depthwise convolution (as shifted sums: `taps`) with its
        neighbours, leaving the dense convolutions to cuDNN. On the H200, a window in a batch of 128 in
        fp16: 0.40x the graphed eager decode (23.5 against 58.5 µs; bench/codec_profile.py). Compiling
        happens at the first call (tens of seconds; torch caches the result on disk). `options`:
        inductor settings."""
        if self.cropped_taps is None or not self.crop:
            raise ValueError("the compiled SNAC decode needs the cropped decoder")

        def window_taps(
            tokens: torch.Tensor, keys: torch.Tensor, tail_rows: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.decode_orpheus_window(tokens, keys, tail_rows=tail_rows, taps=True)

        # Every compiled codec of a process shares `window_taps`'s code object, and dynamo keeps
        # 8 compiles per code object by default, then runs the rest uncompiled: one codec needs 2-3
        # per window kind (batch 1, the dynamic batch, on a CPU also batches of 16+; kinds: regular
        # windows, full-window tails, each compiled lead size), so a codec with its tails and leads
        # compiled, or a benchmark or a test building several, would run out.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = torch.compile(
            window_taps,
            backend=backend,
            dynamic=False,
            options=(REALIZE_REUSED if options is None else options) if backend == "inductor" else None,
        )

        def decode(
            tokens: torch.Tensor, keys: torch.Tensor, tail_rows: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor]:
            rows = tokens.shape[1]
            if rows != WINDOW and (rows not in LEAD_ROWS or tail_rows):
                raise ValueError(
                    f"the compiled decode takes regular {WINDOW}-row windows and whole lead windows "
                    f"of {LEAD_ROWS} rows, not {rows} (tail rows {tail_rows})"
                )
            if tail_rows % FRAME or not 0 <= tail_rows < WINDOW:
                raise ValueError(
                    f"a tail window keeps whole frames of fewer than {WINDOW} rows, not {tail_rows}"
                )
            torch._dynamo.maybe_mark_dynamic(tokens, 0)
            torch._dynamo.maybe_mark_dynamic(keys, 0)
            return fn(tokens, keys, tail_rows)

        return decode
