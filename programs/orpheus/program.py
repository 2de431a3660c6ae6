"""Orpheus program: Llama-3.2-3B emitting SNAC 24 kHz codes, 7 tokens per 85 ms frame.

Based on the reference implementation (canopyai/Orpheus-TTS: prompt layout in `engine_class.py`,
token handling and windowing in `decoder.py`) and the program contract in programs/base.py.

Which generated tokens count as audio follows the reference decoder exactly, because the count of
accepted tokens decides both the frame slot of the next token and where windows start:
- 128258 stops the request;
- a token t is AUDIO when its code t - 128266 - 4096 * (n_audio % 7) is > 0 for the slot it
  lands in (n_audio = audio tokens accepted so far); it is appended and advances the count. That
  includes codes above 4095 (tokens of a later slot, or past the audio block): the reference
  accepts them too, and then drops every window holding one (`valid` is False for it);
- everything else is OTHER (fed back to the LM, never decoded, count unchanged): text and special
  tokens, tokens of an earlier slot, and code 0 itself, which the reference skips (`token > 0`).
Constrained sampling (`candidates`) offers only codes 1..4095 of the current slot plus the stop
token, so every window it produces is decodable.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import Attention, LMProgram, Rows, TokenKind, Voice
from programs.blocks import fp8
from programs.orpheus.spec import AUDIO_BASE, CODEBOOK, FRAME, STOP_TOKEN

if TYPE_CHECKING:  # torch modules load only in the process that needs them
    from programs.blocks.text_tokenizer import TextTokenizer
    from programs.orpheus.codec import SnacCodec
    from programs.orpheus.model import LlamaLM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


class OrpheusProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "orpheus"
    # SNAC is small (20 M parameters) and tanh-saturating; fp32 keeps it faithful to the reference
    # (--codec-dtype bfloat16/float16 trade that for speed; tests/test_codec_precision.py: SNR).
    codec_dtype: torch.dtype = torch.float32
    codec_compiled_tails = True  # SnacCodec.compiled takes a full window's last frame as well
    # ... and lead windows (first chunks) of 2 and 3 frames, a loaded server's first chunks, which a
    # burst's streams send together; a lone stream's 1-frame first chunk decodes uncompiled (a compile
    # less at startup)
    codec_compiled_leads = (14, 21)
    mixed_prefill = True  # LlamaLM's GEMMs all go through fp8.linear, fused or not

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)  # keyword arguments: see LMProgram
        self.lm: LlamaLM | None = None  # set by load_lm (gpu_worker)
        self.codec: SnacCodec | None = None  # set by load_codec (codec_worker)
        self._tokenizer: TextTokenizer | None = None  # loaded on first preprocess (tokenizer_worker)
        self._candidate_table: torch.Tensor | None = None  # [7, 4096] candidates per frame slot
        # Shapes from the shipped config, so weight-free programs know them too; load_lm rereads
        # them from the checkpoint actually loaded.
        self._set_lm_constants(self.read_config("lm_config"))

    def _set_lm_constants(self, cfg: dict[str, Any]) -> None:
        self.vocab_size = cfg["vocab_size"]
        self.set_decoder_shapes(cfg)

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        from programs.orpheus.model import LlamaLM

        self.lm = self.lm_weights(LlamaLM)
        self._set_lm_constants(self.lm.config)
        if self.device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
            self.lm.fuse(max_positions=max(self.spec["max_tokens"], 4096))
        if self.quantization == "fp8":
            self.lm.quantize_fp8()
        if self.lm_head == "audio":
            # Codec tokens of all 7 frame slots, then stop: 28,673 of 156,940 rows of the head.
            ids = [*range(AUDIO_BASE, AUDIO_BASE + FRAME * CODEBOOK), STOP_TOKEN]
            self.head_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
            # Rows padded with zeros to a multiple of 64: an output row of 28,673 bf16 values is not
            # 16-byte aligned, and cuBLAS then takes a slow pre-Hopper kernel (0.77 ms at batch 384,
            # 6 % of the step, in a `voxpipe bench profile` of the bf16 step).
            weight = self.lm.lm_head.weight
            self._head_weight = weight.new_zeros(-(-len(ids) // 64) * 64, weight.shape[1])  # [V'', H]
            self._head_weight[: len(ids)] = weight[self.head_ids]

    def load_codec(self) -> None:
        from programs.orpheus.codec import SnacCodec

        self.codec = self.codec_model(SnacCodec)

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        return self.lm.embed(ids[:, 0])  # [N, 1] int64 → [N, H]

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.lm.backbone(hidden, pos, attn)  # [N, H] → [N, H]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_ids is not None:  # [B, H] → [B, 1, V'] float32, columns = head_ids
            # through fp8.linear as the full head's Linear: in the decode graphs' row tiles
            logits = fp8.linear(hidden, self._head_weight)[:, : len(self.head_ids)]
            return logits.float()[:, None, :]
        return self.lm.logits(hidden)[:, None, :]  # [B, H] → [B, 1, V] float32

    def candidates(self, n_audio: torch.Tensor) -> torch.Tensor:
        """[B] int64 → [B, 4096] int64: codes 1..4095 of the next frame slot, then the stop token."""
        table = self._candidate_table
        if table is None or table.device != n_audio.device:
            codes = torch.arange(1, CODEBOOK, dtype=torch.int64, device=n_audio.device)  # [4095]
            ids = (
                AUDIO_BASE + CODEBOOK * torch.arange(FRAME, device=n_audio.device)[:, None] + codes
            )  # [7, 4095]
            stop = torch.full_like(ids[:, :1], STOP_TOKEN)  # [7, 1]
            table = self._candidate_table = torch.cat([ids, stop], dim=1)  # [7, 4096], one row per slot
        return table[n_audio % FRAME]  # [B, 4096]

    # --- tokens → meaning (host) ---------------------------------------------------------------
    def classify(self, tokens: torch.Tensor, n_audio: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] int64, n_audio [B] int64 → kinds [B] int64 (reference decoder rules)."""
        tok = tokens[:, 0]  # [B]
        code = tok - AUDIO_BASE - CODEBOOK * (n_audio % FRAME)  # [B]
        # Tokens below the custom-token block give negative codes, so `> 0` alone matches the
        # reference's "custom token with a positive code" test.
        kinds = torch.where(code > 0, int(TokenKind.AUDIO), int(TokenKind.OTHER))
        return torch.where(tok == STOP_TOKEN, int(TokenKind.STOP), kinds)

    # --- codec (graph) -------------------------------------------------------------------------
    def detokenize(
        self, tokens: torch.Tensor, keys: torch.Tensor, tail_rows: int = 0, streams=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, R, 1] int64, keys [Bd] int64 → audio [Bd, S] float32, valid [Bd] bool: R = 28 gives
        S = 2048 (the reference's kept samples); a lead window (R = 7, 14, 21: `detok_lead`) of
        L = R / 7 frames gives all L * 2048 samples of their SNAC decode; a tail window (R = 7..28,
        tail_rows = 7) gives the last frame's 2048 samples of the R / 7-frame decode."""
        return self.codec.decode_orpheus_window(tokens, keys, tail_rows=tail_rows)

    def compiled_detokenize(self, backend: str = "inductor"):
        """The cropped SNAC decode of regular windows, of their tails and of lead windows under
        torch.compile (SnacCodec.compiled)."""
        return self.codec.compiled(backend) if self.codec.crop else None

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> np.ndarray:
        """`[128259] + encode(f"{voice}: {text}") + [128009, 128260, 128261, 128257]` → [R, 1] int32.
        Orpheus clones no voice (reference_sample_rate 0): a cloned `voice` is refused."""
        if voice is not None:
            raise ValueError(
                f"{self.name} does not clone voices; choose one of: {', '.join(self.spec['voices'])}"
            )
        unknown = sorted(set(model_kwargs) - {"voice"})
        if unknown:
            raise ValueError(f"orpheus takes only the model option 'voice'; got {', '.join(unknown)}")
        voice = model_kwargs.get("voice") or self.spec["default_voice"]
        if voice not in self.spec["voices"]:
            raise ValueError(f"unknown voice {voice!r}; orpheus voices: {', '.join(self.spec['voices'])}")
        if not text or not text.strip():
            raise ValueError("text is empty; give the text to speak")
        if self._tokenizer is None:
            self.load_prompts()
        body = self._tokenizer.encode(self.spec["text_template"].format(voice=voice, text=text))
        ids = [*self.spec["prefix_ids"], *body, *self.spec["suffix_ids"]]
        return np.asarray(ids, dtype=np.int32)[:, None]


PROGRAM = OrpheusProgram
