"""Higgs Audio v2 program (bosonai/higgs-audio-v2-generation-3B-base with
bosonai/higgs-audio-v2-tokenizer): a Llama-3.2-3B backbone with DualFFN layers emitting rows of 8
codebooks in a delay pattern, and the tokenizer's DAC decoder streamed per request. See
programs/higgs_tts/spec.py for the facts and the row values, model.py for the LM, codec.py for the
codec.

The contract pieces it uses (programs/base.py): prompt rows (a text id in column 0, or a cloned
voice's clip row), `Rows` (a row's step says whether it is a prompt row, which DualFFN takes as
text unless it is a clip row, or a generated row, audio; `rows.prompt_rows`, where the step gives
it, says so for the whole step as a static split, so that a decode step runs only the audio
feed-forward path; `embed` leaves the flags and the split for `backbone` in `self._audio` /
`self._n_text`, as the two always run in one forward pass), `decode_tokens` (codebooks 1..7 from the same hidden
state, and the delay pattern's forced bos / eos ids from the step and the previous row) and codec
streams (the codec undoes the delay pattern per stream).

Voice cloning (`reference_sample_rate` 24 kHz): the codec_worker encodes a clip into the
tokenizer's codes (encoder.py, `encode_references`), and `preprocess` puts them in the prompt the
way the reference's processor does (spec.py): the clip's transcript as a user turn, its codes as an
assistant turn of prompt audio rows, which `embed` reads through the audio embedding and flags for
DualFFN's audio path. The reference decodes only the generated rows (from the last all-bos row
on), so a cloned request's codec stream starts fresh, as any other (no `codec_prefix`).

Request options (model_kwargs): `scene` (the scene description: the voice and the room) and
`system` (the system message).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import (
    Attention,
    CodecStreams,
    LMProgram,
    PromptRows,
    Reference,
    Rows,
    Sampler,
    TokenKind,
    Voice,
)
from programs.higgs_tts import spec as h

if TYPE_CHECKING:
    from programs.higgs_tts.codec import HiggsCodec
    from programs.higgs_tts.encoder import HiggsEncoder
    from programs.higgs_tts.model import HiggsLM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_OPTIONS = ("scene", "system")
# Stand-in ids of the scene markers for the offline tokenizer (tiny models, no checkpoint): Llama-3
# reserved slots; a real tokenizer names its own.
_OFFLINE_MARKERS = {h.SCENE_START: 128017, h.SCENE_END: 128018, h.AUDIO_EOS: 128012}


class HiggsTtsProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "higgs_tts"
    codec_dtype: torch.dtype = torch.float32
    codec_streams = True  # each row decoded once, with state per request (programs/base.py)
    codec_merge = (2, 4, 8)  # a stream's waiting rows in one call: its decoder runs their frames at once
    # One-row windows carry 40 ms each: the first four audible ones go together, so a listener starts
    # with 160 ms in hand while the next window comes (3 rows more before the first audio).
    detok_first_windows = 4
    uses_repetition_penalty = False  # the reference refuses penalties on audio logits
    sized_options = _OPTIONS
    reference_sample_rate = h.SAMPLE_RATE  # the tokenizer's rate: a clip becomes its codes

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.lm: HiggsLM | None = None
        self.codec: HiggsCodec | None = None
        self.encoder: HiggsEncoder | None = None
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

        self.lm = self.lm_weights(HiggsLM)
        if self.device.type == "cuda":
            self.lm.fuse()
        if self.quantization == "fp8":  # the backbone's GEMMs row-invariant (HiggsLM.quantize_fp8)
            self.lm.quantize_fp8()
        self._set_lm_constants(self.lm.config)

    def load_codec(self) -> None:
        from programs.higgs_tts.codec import HiggsCodec

        self.codec = self.codec_model(HiggsCodec)

    def load_encoders(self) -> None:
        """The tokenizer's encoder (fp32: the nearest code is chosen exactly): the checkpoint's, or
        random weights sharing the codec's codebooks and output projections."""
        from programs.higgs_tts.encoder import HiggsEncoder

        if self.load_format == "dummy" or self.codec_weights is None:
            self.encoder = HiggsEncoder.from_config(
                self.config_path("codec_config"), torch.float32, self.device
            )
            shared = {n: t for n, t in self.codec.state_dict().items() if n.startswith("quantizer.")}
            unexpected = self.encoder.load_state_dict(shared, strict=False).unexpected_keys
            if unexpected:
                raise KeyError(f"the encoder has no place for the codec's {unexpected[:3]}")
        else:
            self.encoder = HiggsEncoder.from_pretrained(self.codec_weights, torch.float32, self.device)

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Clips at 24 kHz → {"codes": [T, 8] int32} each (25 Hz), one clip at a time (encoder.py)."""
        out = []
        for clip in clips:
            audio = torch.from_numpy(np.asarray(clip.audio, dtype=np.float32)).to(self.device)
            out.append({"codes": self.encoder.encode(audio).cpu().numpy().astype(np.int32)})
        return out

    # --- per-request state: the repetition-aware sampling window --------------------------------
    def init_state(self, num_slots: int) -> None:
        """Each slot's last RAS_WINDOW audio rows, a ring by generated row (-1: none yet)."""
        self._recent = torch.full(
            (num_slots, h.RAS_WINDOW, h.N_CODEBOOKS), -1, dtype=torch.int64, device=self.device
        )

    def admit(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """The ring starts empty, or with a cloned voice's last clip rows (`ras_window`, oldest first)
        where the generated rows will overwrite the oldest first, as the reference's window of its
        audio ids slides from the clip into the generated rows."""
        from gpu_worker.runner.slots import to_device

        ring = np.full((h.RAS_WINDOW, h.N_CODEBOOKS), -1, dtype=np.int64)
        window = state.get("ras_window")
        if window is not None:
            k = len(window)
            ring[(np.arange(k) - k) % h.RAS_WINDOW] = window  # the last clip row at index -1
        self._recent[slot] = to_device(torch.from_numpy(ring), self.device)

    def check_prompt(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
        if set(state) - {"ras_window"}:
            return f"{self.name} prompts carry at most the state ['ras_window']; got {sorted(state)}"
        window = state.get("ras_window")
        if window is not None and (
            window.ndim != 2
            or window.shape[1] != h.N_CODEBOOKS
            or not 1 <= len(window) <= h.RAS_WINDOW
            or window.min() < 0
            or window.max() >= h.CODEBOOK_IDS
        ):
            return f"'ras_window' holds 1 to {h.RAS_WINDOW} audio rows of {h.N_CODEBOOKS} ids below {h.CODEBOOK_IDS}"
        if len(rows) == 0 or rows[-1, 0] != h.AUDIO_OUT_BOS:
            return "a prompt ends with <|audio_out_bos|>"
        audio = rows[:, 1] >= h.PROMPT_AUDIO
        text, sound = rows[~audio], rows[audio]
        if (text[:, 1:] != 0).any():
            return "a prompt text row holds a text id in column 0 and zeros"
        if ((sound < h.PROMPT_AUDIO) | (sound >= h.PROMPT_AUDIO + h.CODEBOOK_IDS)).any():
            return f"a prompt audio row holds {h.PROMPT_AUDIO} + a codebook id in every column"
        return ""

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """[N, 8] rows → [N, H]: a prompt row is its text id's embedding, or for a prompt audio row
        (a cloned voice's clip) the sum of its codebooks' embeddings, as is a generated row (the
        program's marker values read as stream eos). Prompt rows are rows [0, rows.prompt_rows)
        where the step says so (each part embedded alone), else those with step < 0. Leaves which
        rows DualFFN takes as audio for `backbone`."""
        k = rows.prompt_rows
        self._n_text, self._audio = k, None
        if k is not None:
            parts = []
            if k:
                emb, self._audio = self._prompt(ids[:k])
                parts.append(emb)
            if k < len(ids):
                parts.append(self.lm.audio_rows(ids[k:].clamp(max=h.STREAM_EOS)))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        prompt = rows.step < 0
        emb, clip = self._prompt(torch.where(prompt[:, None], ids, 0))
        generated = self.lm.audio_rows(torch.where(prompt[:, None], 0, ids.clamp(max=h.STREAM_EOS)))
        self._audio = ~prompt | clip
        return torch.where(prompt[:, None], emb, generated)

    def _prompt(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt rows [k, 8] → (embeddings [k, H], which are audio rows [k] bool)."""
        audio = ids[:, 1] >= h.PROMPT_AUDIO
        codes = torch.where(audio[:, None], ids - h.PROMPT_AUDIO, 0)
        text = self.lm.text_rows(torch.where(audio, 0, ids[:, 0]))
        return torch.where(audio[:, None], self.lm.audio_rows(codes), text), audio

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
        row = delay_pattern(self._repetition_aware(row, logits, sample, rows.slot), rows.step, rows.prev)
        self._recent[rows.slot, rows.step % h.RAS_WINDOW] = row
        return row

    def _repetition_aware(
        self, row: torch.Tensor, logits: torch.Tensor, sample: Sampler, slot: torch.Tensor
    ) -> torch.Tensor:
        """Repetition-aware sampling (the reference's `ras_win_len` / `ras_win_max_num_repeat`): a
        codebook's id that the request's last RAS_WINDOW audio rows hold RAS_MAX_REPEAT times or
        more (stream bos, eos and the program's markers not counted) is drawn again from its raw
        logits' softmax, whatever the request's temperature. Where the delay pattern forces an id,
        the forced id replaces either draw, as the reference forces it before drawing."""
        recent = self._recent[slot]  # [B, W, 8]
        seen = ((recent == row[:, None]) & (recent >= 0) & (recent < h.STREAM_BOS)).sum(1)  # [B, 8]
        return torch.where(seen >= h.RAS_MAX_REPEAT, sample.untempered(logits, h.RAS_SALT), row)

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
        """[Bd, R, 8] rows continuing each entry's stream → audio [Bd, R * 960], valid [Bd] for one
        row, else [Bd, R], each row's (a row completes no frame yet: the delay pattern's first
        rows and the decoder's look-ahead; a merged window's rows, programs/base.py codec_merge);
        the decoder has no noise: keys unused."""
        audio, valid = self.codec.decode_stream(tokens, streams.slot, streams.fresh)
        return audio.clamp(-1, 1), (valid[:, 0] if valid.shape[1] == 1 else valid)

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def _ids(
        self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None
    ) -> list[int | np.ndarray]:
        """The chat template's pieces (spec.py) for the user's `text`, as text: text ids, and for a
        cloned `voice` its clip's prompt audio rows [T + 9, 8] (`clip_rows`) in place."""
        if self._tokenizer is None:
            self.load_prompts()
        tok = self._tokenizer
        system = (model_kwargs.get("system") or h.SYSTEM_MESSAGE).strip()
        scene = (model_kwargs.get("scene") or h.DEFAULT_SCENE).strip()
        ids: list[int | np.ndarray] = [h.BEGIN_OF_TEXT, h.START_HEADER, *tok.text_ids("system"), h.END_HEADER]
        ids += [
            *tok.text_ids(f"\n\n{system}\n\n"),
            self._marker(h.SCENE_START),
            *tok.text_ids(f"\n{scene}\n"),
        ]
        ids += [self._marker(h.SCENE_END), h.EOT]
        if voice is not None:
            ids += self._turn("user", voice.text.strip())
            ids += [*self._turn("assistant", None)[:-1], h.AUDIO_OUT_BOS, clip_rows(_codes(voice))]
            ids += [self._marker(h.AUDIO_EOS), h.EOT]
        ids += self._turn("user", text.strip())
        return [*ids, *self._turn("assistant", None)[:-1], h.AUDIO_OUT_BOS]

    def _turn(self, role: str, text: str | None) -> list[int]:
        """`<|start_header_id|>role<|end_header_id|>\\n\\n` + text + `<|eot_id|>` (text as text)."""
        tok = self._tokenizer
        body = tok.text_ids(f"\n\n{text}" if text is not None else "\n\n")
        return [h.START_HEADER, *tok.text_ids(role), h.END_HEADER, *body, h.EOT]

    def _marker(self, token: str) -> int:
        found = self._tokenizer.tokenizer.token_to_id(token)
        if found is not None:
            return found
        if self._tokenizer.is_real:
            raise ValueError(f"the tokenizer has no {token}")
        return _OFFLINE_MARKERS[token]

    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> PromptRows:
        """The chat template (and a cloned voice's turns) → rows [R, 8] int32: a text row is its id
        in column 0 and zeros, a prompt audio row PROMPT_AUDIO + each codebook's id."""
        model_kwargs = self._options(model_kwargs)
        if not text or not text.strip():
            raise ValueError("text is empty; give the text to speak")
        rows = _rows(self._ids(text, model_kwargs, voice))
        if voice is None:
            return PromptRows(rows)
        # the clip's last audio rows open the repetition-aware sampling window (admit)
        window = clip_rows(_codes(voice))[-h.RAS_WINDOW :] - h.PROMPT_AUDIO
        return PromptRows(rows, {"ras_window": window.astype(np.int32)})

    def _options(self, model_kwargs: dict[str, str]) -> dict[str, str]:
        if model_kwargs.get("voice"):
            raise ValueError(
                f"{self.spec['name']} has no preset voices: describe the voice in the scene option, "
                "or clone one from a clip"
            )
        model_kwargs = {k: v for k, v in model_kwargs.items() if k != "voice"}
        unknown = sorted(set(model_kwargs) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"{self.spec['name']} takes the model options {', '.join(_OPTIONS)}; got {', '.join(unknown)}"
            )
        return model_kwargs

    def prompt_overhead(self) -> int:
        """The template's rows around an empty text, and one for the text's leading newlines."""
        return len(_rows(self._ids("", {}))) + 1

    def option_rows(self, model_kwargs: dict[str, str], voice: Voice | None = None) -> int:
        """The rows the options and a cloned voice's turns (its transcript, its clip's T + 9 rows)
        add to the template."""
        model_kwargs = self._options(model_kwargs)
        return max(0, len(_rows(self._ids("", model_kwargs, voice))) - len(_rows(self._ids("", {}))))


def _codes(voice: Voice) -> np.ndarray:
    """A cloned voice's codes [T, 8], checked."""
    codes = voice.features.get("codes")
    if (
        codes is None
        or codes.ndim != 2
        or codes.shape[1] != h.N_CODEBOOKS
        or not len(codes)
        or codes.dtype.kind not in "iu"
        or codes.min() < 0
        or codes.max() >= h.CODES
    ):
        raise ValueError(
            f"a higgs voice is 'codes', frames of {h.N_CODEBOOKS} tokenizer codes in [0, {h.CODES})"
        )
    if not voice.text.strip():
        raise ValueError("a higgs voice needs its clip's transcript (ref_text): the prompt speaks it first")
    return codes


def clip_rows(codes: np.ndarray) -> np.ndarray:
    """A clip's codes [T, 8] → its prompt audio rows [T + 9, 8] int32: a stream bos frame, the
    codes, a stream eos frame, in the delay pattern (codebook k k rows late, stream bos before and
    stream eos after), each id + PROMPT_AUDIO."""
    t = len(codes) + 2
    framed = np.concatenate(
        [np.full((1, h.N_CODEBOOKS), h.STREAM_BOS), codes, np.full((1, h.N_CODEBOOKS), h.STREAM_EOS)]
    )
    out = np.empty((t + h.N_CODEBOOKS - 1, h.N_CODEBOOKS), dtype=np.int32)
    for k in range(h.N_CODEBOOKS):
        out[:k, k] = h.STREAM_BOS
        out[k : k + t, k] = framed[:, k]
        out[k + t :, k] = h.STREAM_EOS
    return out + h.PROMPT_AUDIO


def _rows(pieces: list[int | np.ndarray]) -> np.ndarray:
    """Text ids and blocks of prompt audio rows → rows [R, 8] int32 (a text id in column 0)."""
    blocks, text = [], []
    for piece in pieces:
        if isinstance(piece, np.ndarray):
            blocks += [_text_rows(text), piece]
            text = []
        else:
            text.append(piece)
    return np.concatenate([*blocks, _text_rows(text)]).astype(np.int32)


def _text_rows(ids: list[int]) -> np.ndarray:
    rows = np.zeros((len(ids), h.N_CODEBOOKS), dtype=np.int32)
    rows[:, 0] = ids
    return rows


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
