"""CSM program (sesame/csm-1b): Llama-1B backbone over 32-codebook Mimi frames, a depth decoder for
codebooks 1..31, Mimi 24 kHz. See programs/csm/spec.py for the row layout and the reference facts.

The contract pieces it uses beyond a single-codebook model (programs/base.py): `decode_tokens`
(the depth decoder, inside the step), `input_vocab_size` (text rows carry text ids),
`uses_repetition_penalty = False` (the reference has none), `codec_streams` (Mimi decodes each
frame once, with every request's decoder state in a codec slot: a stream's first audio needs one
frame, and its audio is MimiModel.decode of the whole utterance) and a `classify` on the whole frame.

Request options (model_kwargs): `voice` = the speaker id (0..9) and `context`, a JSON list of earlier
turns `[{"speaker": 1, "text": "…", "codes": [[32 codes] per frame]}]`: each becomes the reference's
`[speaker]text` turn followed by its audio frames and the all-zero end frame. `codes` are Mimi codes
(for instance of an earlier reply, or `MimiModel.encode` of a recording); the reference's chat
template requires audio on every turn but the last, so a context turn without codes is refused.

Voice cloning (programs/base.py, "Reference audio"): a reference clip at 24 kHz is encoded with
Mimi's encoder (programs/blocks/mimi_encoder.py, the codec's own weights) into its 32-codebook
frames, the feature `codes` [T, 32] int32; the cloned voice is one context turn in the request's
speaker, `[speaker]ref_text` and those frames, ahead of any `context` turns, so the model continues
the conversation in that voice, as the reference does with the clip as an audio turn.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import Attention, CodecStreams, LMProgram, Reference, Rows, Sampler, TokenKind, Voice
from programs.csm.spec import EOS_ID, N_CODEBOOKS, TEXT_MARK

if TYPE_CHECKING:
    from programs.blocks.mimi_encoder import MimiEncoder
    from programs.blocks.text_tokenizer import TextTokenizer
    from programs.csm.codec import MimiCodec
    from programs.csm.model import CsmLM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_MAX_CONTEXT_TURNS = 16


class CsmProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "csm"
    codec_dtype: torch.dtype = torch.float32
    uses_repetition_penalty = False
    sized_options = ("context",)  # context turns are prompt rows (option_rows)
    codec_streams = True  # each frame decoded once, with state per request (programs/base.py)
    codec_merge = (2, 4, 8)  # a stream's waiting frames decode in one call (its decoder takes any R)
    reference_sample_rate = 24000  # Mimi's rate: a clip becomes frames of the codec's own codes

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.lm: CsmLM | None = None
        self.codec: MimiCodec | None = None
        self.encoder: MimiEncoder | None = None
        self._tokenizer: TextTokenizer | None = None
        self._set_lm_constants(self.read_config("lm_config"))

    def _set_lm_constants(self, cfg: dict[str, Any]) -> None:
        self.vocab_size = cfg["vocab_size"]
        self.text_vocab_size = cfg["text_vocab_size"]
        self.set_decoder_shapes(cfg)
        if cfg["num_codebooks"] != N_CODEBOOKS:
            raise ValueError(f"CSM rows hold {N_CODEBOOKS} codebooks; the config has {cfg['num_codebooks']}")

    @property
    def input_vocab_size(self) -> int:
        return self.text_vocab_size  # text rows hold text ids; frames hold codes < 2051

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        from programs.csm.model import CsmLM

        # lm_head "audio" is what CSM's head is already (2051 codes); fp8 is not implemented here.
        if self.quantization != "none":
            raise ValueError(f"{self.name} runs with --quantization none (got {self.quantization!r})")
        self.lm = self.lm_weights(CsmLM)
        self._set_lm_constants(self.lm.config)

    def load_codec(self) -> None:
        from programs.csm.codec import MimiCodec

        self.codec = self.codec_model(MimiCodec)

    def load_encoders(self) -> None:
        """Mimi's encoder with the loaded codec's weights (fp32: the nearest code is chosen exactly)."""
        from programs.blocks.mimi_encoder import MimiEncoder

        model = self.codec.model
        encoder = MimiEncoder(model.config.to_dict(), n_q=N_CODEBOOKS).to(self.device)
        loaded = encoder.load_weights(model.state_dict().items())
        missing = {n for n, _ in encoder.named_parameters()} - loaded
        if missing:
            raise ValueError(f"the codec lacks {len(missing)} encoder weights, e.g. {sorted(missing)[:3]}")
        self.encoder = encoder.eval()

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Clips at 24 kHz → {"codes": [T, 32] int32} each (T = ceil(S / 1920)), in one padded batch."""
        lengths = torch.tensor([len(c.audio) for c in clips], dtype=torch.int64)
        audio = torch.zeros(len(clips), int(lengths.max()))
        for b, c in enumerate(clips):
            audio[b, : len(c.audio)] = torch.from_numpy(np.asarray(c.audio, dtype=np.float32))
        codes, frames = self.encoder.encode(audio.to(self.device), lengths.to(self.device))
        codes, frames = codes.cpu().numpy(), frames.cpu().tolist()
        return [{"codes": codes[b, : frames[b]].astype(np.int32)} for b in range(len(clips))]

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        return self.lm.embed(ids)  # [N, 32] → [N, H]

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.lm.backbone(hidden, pos, attn)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.logits(hidden)[:, None, :]  # [B, 1, 2051]: codebook 0

    def decode_tokens(
        self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler, rows: Rows
    ) -> torch.Tensor:
        return self.lm.depth(hidden, c0, sample)  # [B, 32]

    # --- tokens → meaning ----------------------------------------------------------------------
    def classify(self, tokens: torch.Tensor, n_audio: torch.Tensor) -> torch.Tensor:
        """[B, 32] → kinds [B]: the reference stops on a frame whose codebooks 0..30 are all 0
        (`input_ids[:, -1, :-1] == codebook_eos_token_id`); every other frame is audio."""
        stop = (tokens[:, :-1] == 0).all(dim=1)
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
        """[Bd, R, 32] frames continuing each entry's stream → audio [Bd, R * 1920], valid [Bd] (all
        True; Mimi has no noise: keys unused; CSM has no tail windows: tail_rows is always 0).

        The LM's extra ids (2048..2050) have no Mimi code; `decode_stream` decodes them as the last
        code, 2047: trained weights do not sample them (the reference's decode would fail on one),
        random weights do in ~3.5 % of csm-1b frames, and the frame still sounds, so the stream keeps
        its timeline."""
        audio = self.codec.decode_stream(tokens, streams.slot, streams.fresh)
        return audio.float().clamp(-1, 1), torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def _turn(self, speaker: str, text: str) -> list[list[int]]:
        body = self._tokenizer.text_ids(f"[{speaker}]{text}")  # as text: no control token from a client
        ids = [self.spec["bos_id"], *body, EOS_ID]
        return [[i] + [TEXT_MARK] * (N_CODEBOOKS - 1) for i in ids]

    def option_rows(self, model_kwargs: dict[str, str], voice: Voice | None = None) -> int:
        """The rows of the cloned voice's turn and of the context turns: each turn's text rows, its
        frames and the end frame."""
        if self._tokenizer is None:
            self.load_prompts()
        turns = _parse_context(model_kwargs.get("context") or "[]")
        rows = sum(len(self._turn(str(t["speaker"]), t["text"])) + len(t["codes"]) + 1 for t in turns)
        if voice is not None:
            rows += len(self._voice_rows(self._speaker(model_kwargs), voice))
        return rows

    def _speaker(self, model_kwargs: dict[str, str]) -> str:
        speaker = model_kwargs.get("voice") or self.spec["default_voice"]
        if not speaker.isdigit():
            raise ValueError(f"voice is a CSM speaker id (a non-negative integer); got {speaker!r}")
        return speaker

    def _voice_rows(self, speaker: str, voice: Voice) -> list[list[int]]:
        """A cloned voice as a context turn in `speaker`: its text's rows, its frames, the end frame."""
        codes = voice.features.get("codes")
        if (
            codes is None
            or codes.ndim != 2
            or codes.shape[1] != N_CODEBOOKS
            or not len(codes)
            or codes.dtype.kind not in "iu"
            or codes.min() < 0
            or codes.max() >= 2048
        ):
            raise ValueError(f"a csm voice is 'codes', frames of {N_CODEBOOKS} Mimi codes in [0, 2048)")
        return self._turn(speaker, voice.text) + codes.tolist() + [[0] * N_CODEBOOKS]

    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> np.ndarray:
        """The cloned voice's turn, context turns, then `[speaker]text` → rows [R, 32] int32 (see the
        module docstring)."""
        unknown = sorted(set(model_kwargs) - {"voice", "context"})
        if unknown:
            raise ValueError(f"csm takes the model options 'voice' and 'context'; got {', '.join(unknown)}")
        speaker = self._speaker(model_kwargs)
        if not text or not text.strip():
            raise ValueError("text is empty; give the text to speak")
        if self._tokenizer is None:
            self.load_prompts()
        rows: list[list[int]] = [] if voice is None else self._voice_rows(speaker, voice)
        for turn in _parse_context(model_kwargs.get("context") or "[]"):
            rows += self._turn(str(turn["speaker"]), turn["text"])
            rows += [list(f) for f in turn["codes"]] + [[0] * N_CODEBOOKS]  # frames, then the end frame
        rows += self._turn(speaker, text)
        return np.asarray(rows, dtype=np.int32)


def _parse_context(raw: str) -> list[dict[str, Any]]:
    try:
        turns = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"context is not JSON: {e}") from None
    if not isinstance(turns, list) or len(turns) > _MAX_CONTEXT_TURNS:
        raise ValueError(f"context is a JSON list of at most {_MAX_CONTEXT_TURNS} turns")
    for i, t in enumerate(turns):
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("text"), str)
            or not str(t.get("speaker", "")).isdigit()
        ):
            raise ValueError(f"context turn {i} needs 'speaker' (an integer) and 'text' (a string)")
        codes = t.get("codes")
        if not isinstance(codes, list) or not codes:
            raise ValueError(
                f"context turn {i} has no 'codes': every context turn carries its audio as Mimi codes"
            )
        if not all(
            isinstance(f, list)
            and len(f) == N_CODEBOOKS
            and all(isinstance(c, int) and 0 <= c < 2048 for c in f)
            for f in codes
        ):
            raise ValueError(
                f"context turn {i}: 'codes' is a list of frames of {N_CODEBOOKS} Mimi codes in [0, 2048)"
            )
    return turns


PROGRAM = CsmProgram
