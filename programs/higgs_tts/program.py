"""Higgs Audio v2 program (bosonai/higgs-audio-v2-generation-3B-base with
bosonai/higgs-audio-v2-tokenizer): a Llama-3.2-3B backbone with DualFFN layers emitting rows of 8
codebooks in a delay pattern, and the tokenizer's DAC decoder streamed per request. See
programs/higgs_tts/spec.py for the facts and the row values, model.py for the LM, codec.py for the
codec.

The contract pieces it uses (programs/base.py): text prompt rows (the text id in column 0),
`Rows` (a row's step says whether it is a prompt row, which DualFFN takes as text, or a generated
row, audio; `rows.prompt_rows`, where the step gives it, says so for the whole step as a static
split, so that a decode step runs only the audio feed-forward path and a prefill step only the
text one; `embed` leaves the flag or the split for `backbone` in `self._audio` / `self._n_text`,
as the two always run in one forward pass), `decode_tokens` (codebooks 1..7 from the same hidden
state, and the delay pattern's forced bos / eos ids from the step and the previous row) and codec
streams (the codec undoes the delay pattern per stream).

Request options (model_kwargs): `scene` (the scene description: the voice and the room) and
`system` (the system message).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import Attention, CodecStreams, LMProgram, PromptRows, Rows, Sampler, TokenKind, Voice
from programs.higgs_tts import spec as h

if TYPE_CHECKING:
    from programs.higgs_tts.codec import HiggsCodec
    from programs.higgs_tts.model import HiggsLM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_OPTIONS = ("scene", "system")
# Stand-in ids of the scene markers for the offline tokenizer (tiny models, no checkpoint): Llama-3
# reserved slots; a real tokenizer names its own.
_OFFLINE_MARKERS = {h.SCENE_START: 128017, h.SCENE_END: 128018}


class HiggsTtsProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "higgs_tts"
    codec_dtype: torch.dtype = torch.float32
    codec_streams = True  # each row decoded once, with state per request (programs/base.py)
    # One-row windows carry 40 ms each: the first four audible ones go together, so a listener starts
    # with 160 ms in hand while the next window comes (3 rows more before the first audio).
    detok_first_windows = 4
    uses_repetition_penalty = False  # the reference refuses penalties on audio logits
    sized_options = _OPTIONS

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.lm: HiggsLM | None = None
        self.codec: HiggsCodec | None = None
        self._tokenizer = None
        # This step's DualFFN text rows [0, n_text) when the step says so, else its audio rows [N] bool
        # (embed → backbone)
        self._n_text: int | None = None
        self._audio: torch.Tensor | None = None
        self._set_lm_constants(self.read_config("lm_config"))
        acoustic = self.read_config("codec_config")["acoustic_model_config"]
        self.flush_rows = h.decoder_lag(acoustic)[1]  # rows past the all-eos row (spec.py)
        # Frame f is whole at row f + 8 (the delay pattern) and leaves the decoder flush_rows later:
        # the first 8 + flush_rows windows of a stream yield no audio.
        self.detok_silent = h.N_CODEBOOKS + self.flush_rows

    def _set_lm_constants(self, cfg: dict[str, Any]) -> None:
        if cfg["num_codebooks"] != h.N_CODEBOOKS or cfg["codebook_size"] != h.CODEBOOK_IDS:
            raise ValueError(
                f"{self.spec['name']}: rows of {h.N_CODEBOOKS} codebooks of {h.CODEBOOK_IDS} ids"
            )
        self.vocab_size = cfg["codebook_size"]
        self.text_vocab_size = cfg["vocab_size"]
        self.set_decoder_shapes(cfg)

    @property
    def input_vocab_size(self) -> int:
        return self.text_vocab_size  # prompt rows carry text ids in column 0

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        from programs.higgs_tts.model import HiggsLM

        if self.quantization != "none":
            raise ValueError(f"{self.name} runs with --quantization none (got {self.quantization!r})")
        self.lm = self.lm_weights(HiggsLM)
        if self.device.type == "cuda":
            self.lm.fuse()
        self._set_lm_constants(self.lm.config)

    def load_codec(self) -> None:
        from programs.higgs_tts.codec import HiggsCodec

        self.codec = self.codec_model(HiggsCodec)

    def check_prompt(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
        if state:
            return f"{self.name} prompts carry no state; got {sorted(state)}"
        if len(rows) == 0 or rows[-1, 0] != h.AUDIO_OUT_BOS:
            return "a prompt ends with <|audio_out_bos|>"
        if (rows[:, 1:] != 0).any():
            return "a prompt row holds a text id in column 0 and zeros"
        return ""

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """[N, 8] rows → [N, H]: a prompt row is its text id's embedding, a generated row the sum of
        its codebooks' (the program's marker values read as stream eos). Prompt rows are rows
        [0, rows.prompt_rows) where the step says so (each part embedded alone), else those with
        step < 0. Leaves which rows DualFFN takes as text for `backbone`."""
        k = rows.prompt_rows
        self._n_text, self._audio = k, None
        if k is not None:
            parts = [self.lm.text_rows(ids[:k, 0])] if k else []
            parts += [self.lm.audio_rows(ids[k:].clamp(max=h.STREAM_EOS))] if k < len(ids) else []
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        text = rows.step < 0
        codes = torch.where(text[:, None], 0, ids.clamp(max=h.STREAM_EOS))
        emb = torch.where(
            text[:, None], self.lm.text_rows(torch.where(text, ids[:, 0], 0)), self.lm.audio_rows(codes)
        )
        self._audio = ~text
        return emb

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        """[N, H] → [N, H]: a decode step's rows take only the audio feed-forward path."""
        return self.lm.backbone(hidden, pos, self._audio, attn, self._n_text)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] → [B, 1, 1026] codebook 0's logits."""
        return self.lm.logits(hidden)[:, :1]

    def decode_tokens(
        self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler, rows: Rows
    ) -> torch.Tensor:
        """Codebooks 1..7 drawn (salt k) from the same hidden state, then the delay pattern's forced
        ids, as the reference's logits processor forces them: stream bos in codebooks k >= step;
        after the first row with an eos (counted from the previous row, whose forced eos are
        FORCED_EOS), one more codebook of forced eos each row; after the all-eos row, flush rows."""
        logits = self.lm.logits(hidden)  # [B, 8, 1026]
        row = torch.stack([c0, *(sample(logits[:, k], k) for k in range(1, h.N_CODEBOOKS))], dim=1)
        return delay_pattern(row, rows.step, rows.prev)

    # --- tokens → meaning ----------------------------------------------------------------------
    def classify(self, tokens: torch.Tensor, n_audio: torch.Tensor) -> torch.Tensor:
        """Every row is audio for the codec (its delay-pattern bos and eos rows included) but the
        stop: the all-eos row, or with a codec look-ahead, the flush row that completes it."""
        if self.flush_rows:
            stop = tokens[:, 0] == h.FLUSH_BASE + self.flush_rows
        else:
            stop = (tokens >= h.STREAM_EOS).all(1)
        return torch.where(stop, int(TokenKind.STOP), int(TokenKind.AUDIO))

    # --- codec (graph) -------------------------------------------------------------------------
    def init_codec_streams(self, n_slots: int) -> None:
        self.codec.init_streams(n_slots)

    def detokenize(
        self,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        tail_rows: int = 0,
        streams: CodecStreams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, 1, 8] rows continuing each entry's stream → audio [Bd, 960], valid [Bd] (the row
        completes no frame yet: the delay pattern's first rows and the decoder's look-ahead; the
        decoder has no noise: keys unused)."""
        audio, valid = self.codec.decode_stream(tokens, streams.slot, streams.fresh)
        return audio.clamp(-1, 1), valid.all(1)

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def _ids(self, text: str, model_kwargs: dict[str, str]) -> list[int]:
        """The chat template's ids (spec.py) for the user's `text`, as text."""
        if self._tokenizer is None:
            self.load_prompts()
        tok = self._tokenizer
        system = (model_kwargs.get("system") or h.SYSTEM_MESSAGE).strip()
        scene = (model_kwargs.get("scene") or h.DEFAULT_SCENE).strip()
        ids = [h.BEGIN_OF_TEXT, h.START_HEADER, *tok.text_ids("system"), h.END_HEADER]
        ids += [
            *tok.text_ids(f"\n\n{system}\n\n"),
            self._marker(h.SCENE_START),
            *tok.text_ids(f"\n{scene}\n"),
        ]
        ids += [self._marker(h.SCENE_END), h.EOT]
        ids += [
            h.START_HEADER,
            *tok.text_ids("user"),
            h.END_HEADER,
            *tok.text_ids(f"\n\n{text.strip()}"),
            h.EOT,
        ]
        ids += [
            h.START_HEADER,
            *tok.text_ids("assistant"),
            h.END_HEADER,
            *tok.text_ids("\n\n"),
            h.AUDIO_OUT_BOS,
        ]
        return ids

    def _marker(self, token: str) -> int:
        found = self._tokenizer.tokenizer.token_to_id(token)
        if found is not None:
            return found
        if self._tokenizer.is_real:
            raise ValueError(f"the tokenizer has no {token}")
        return _OFFLINE_MARKERS[token]

    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> PromptRows:
        if model_kwargs.get("voice"):
            raise ValueError(
                f"{self.spec['name']} has no preset voices: describe the voice in the scene option"
            )
        model_kwargs = {k: v for k, v in model_kwargs.items() if k != "voice"}
        unknown = sorted(set(model_kwargs) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"{self.spec['name']} takes the model options {', '.join(_OPTIONS)}; got {', '.join(unknown)}"
            )
        if voice is not None:
            raise ValueError(f"{self.spec['name']} takes no reference audio")
        if not text or not text.strip():
            raise ValueError("text is empty; give the text to speak")
        ids = np.asarray(self._ids(text, model_kwargs), dtype=np.int32)
        rows = np.zeros((len(ids), h.N_CODEBOOKS), dtype=np.int32)
        rows[:, 0] = ids
        return PromptRows(rows)

    def prompt_overhead(self) -> int:
        """The template's rows around an empty text, and one for the text's leading newlines."""
        return len(self._ids("", {})) + 1

    def option_rows(self, model_kwargs: dict[str, str]) -> int:
        return max(0, len(self._ids("", model_kwargs)) - len(self._ids("", {})))


def delay_pattern(row: torch.Tensor, step: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Sampled rows [B, 8] → the rows the delay pattern leaves (step [B] the rows' place, prev
    [B, 8] each request's previous row). Graph-safe."""
    k = torch.arange(h.N_CODEBOOKS, device=row.device)[None]
    step = step[:, None]
    started = step > 0  # prev is a generated row
    eos = prev >= h.STREAM_EOS  # sampled, forced, or a flush row's
    forced = (prev == h.FORCED_EOS).sum(1, keepdim=True) + 1
    row = torch.where(k < torch.where(started & eos.any(1, keepdim=True), forced, 0), h.FORCED_EOS, row)
    row = torch.where(k >= step, h.STREAM_BOS, row)
    j = torch.where(prev[:, :1] >= h.FLUSH_BASE, prev[:, :1] - h.FLUSH_BASE, 0) + 1
    flush = torch.where(k == 0, h.FLUSH_BASE + j, h.FORCED_EOS)
    return torch.where(started & eos.all(1, keepdim=True), flush, row)


PROGRAM = HiggsTtsProgram
