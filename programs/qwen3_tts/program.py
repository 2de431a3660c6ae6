"""Qwen3-TTS program (Qwen/Qwen3-TTS-12Hz-*-CustomVoice, -VoiceDesign, -Base): a Qwen3 talker over
frames of 16 codebooks, the code predictor for codebooks 1..15 inside the step, and the 12 Hz speech
tokenizer's decoder streamed with state per request. See programs/qwen3_tts/spec.py for the facts
and the row layout, model.py for the LM, codec.py for the codec, clone.py for the Base models'
voice cloning (reference audio: encoders, the cloned prompt, its speaker and clip state).

The contract pieces it uses (programs/base.py): prompt rows with two tracks (text and codec, told
apart by column 2), per-request state (the text that enters as the audio goes, in the streaming
text mode), `Rows` (each frame's text column comes from its request's slot and step),
`decode_tokens` (the code predictor), an output head over the sampleable ids only (`head_ids`: the
2048 codes and the end id, as the reference's suppressed tokens leave them), codec streams, primed
with an in-context clone's clip frames (`codec_prefix`), and appended text (the streaming text
mode's text ids grow while the request runs; Base models, whose requests carry a clip, take none).

Request options (model_kwargs): `voice` (a CustomVoice speaker), `language` (one of the spec's
languages; none: "auto"), `instructions` (CustomVoice's instruction, VoiceDesign's voice
description) and `non_streaming_mode` ("true", the default: the whole text in the prompt, as the
reference's `generate_custom_voice`; "false": the first text token in the prompt, then one per
frame, as its streaming text mode). Base models take a `Voice` (a cloned voice) and the options
`language`, `non_streaming_mode` (default false, as the reference's `generate_voice_clone`) and
`x_vector_only_mode` (clone.py); a Base model without a voice, or another model with one, is a 400.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
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
from programs.qwen3_tts import clone
from programs.qwen3_tts import spec as q

if TYPE_CHECKING:
    from programs.blocks.text_tokenizer import TextTokenizer
    from programs.qwen3_tts.model import Qwen3TtsLM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_OPTIONS = ("voice", "language", "instructions", "non_streaming_mode")


def _stream_audio(
    decode: Callable[..., torch.Tensor], tokens: torch.Tensor, streams: CodecStreams
) -> tuple[torch.Tensor, torch.Tensor]:
    """`detokenize`'s result from a stream decode (`decode_stream` or its compiled form): audio in
    [-1, 1], every window valid."""
    audio = decode(tokens, streams.slot, streams.fresh)
    return audio.float().clamp(-1, 1), torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)


class Qwen3TtsProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "qwen3_tts"
    codec_dtype: torch.dtype = torch.float32
    codec_streams = True  # each frame decoded once, with state per request (programs/base.py)
    codec_merge = (2, 4, 8)  # a stream's waiting frames decode in one call (its decoder takes any R)
    sized_options = ("instructions",)  # an instruction's rows come before the text's
    append_options = {"non_streaming_mode": "false"}  # appended text: the streaming text mode
    mixed_prefill = True  # every backbone GEMM goes through fp8.linear (Linear, and the fused path's)

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.lm: Qwen3TtsLM | None = None
        self.codec = None
        self._tokenizer: TextTokenizer | None = None
        self._text: torch.Tensor | None = None  # [S, T] int64 each slot's text ids (streaming text)
        self._n_text: torch.Tensor | None = None  # [S] int64 how many
        # Base: cloning from reference clips at 24 kHz (0: a preset or described voice)
        self.reference_sample_rate = int(spec.get("reference_sample_rate", 0))
        self.max_ref_frames = int(spec.get("max_ref_frames", 0))
        self._clone: clone.CloneState | None = None  # each slot's speaker vector and clip frames
        self._encoders: clone.Encoders | None = None
        self.appends_text = not self.reference_sample_rate  # a session carries no clip
        self.voice_required = bool(self.reference_sample_rate)  # Base: no preset or described voice
        self._set_lm_constants(self.read_config("lm_config"))
        self.head_ids = torch.tensor([*range(q.CODE_VOCAB), q.CODEC_EOS], device=self.device)

    def _set_lm_constants(self, cfg: dict[str, Any]) -> None:
        tc = cfg["talker_config"]
        self.vocab_size = tc["vocab_size"]
        self.text_vocab_size = tc["text_vocab_size"]
        self.set_decoder_shapes(tc)
        if tc["num_code_groups"] != q.N_CODEBOOKS or tc["vocab_size"] != q.TALKER_VOCAB:
            raise ValueError(
                f"{self.spec['name']}: frames of {q.N_CODEBOOKS} codebooks over {q.TALKER_VOCAB} ids"
            )

    @property
    def input_vocab_size(self) -> int:
        return self.text_vocab_size  # prompt rows carry text ids in column 1

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        from programs.qwen3_tts.model import Qwen3TtsLM

        if self.quantization != "none":
            raise ValueError(f"{self.name} runs with --quantization none (got {self.quantization!r})")
        self.lm = self.lm_weights(Qwen3TtsLM)
        self._set_lm_constants(self.lm.config)
        self.head_weight = self.lm.codec_head.weight[self.head_ids]  # [V', H]

    def load_codec(self) -> None:
        from programs.qwen3_tts.codec import Qwen3TtsCodec

        self.codec = self.codec_model(Qwen3TtsCodec)

    def load_encoders(self) -> None:
        if not self.reference_sample_rate:
            return super().load_encoders()
        self._encoders = clone.Encoders(self)

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Each clip's {"speaker": [D] float32, "codes": [T, 16] int32} (clone.py), as one batch."""
        if self._encoders is None:
            return super().encode_references(clips)
        return self._encoders.encode(clips)

    # --- per-request state ---------------------------------------------------------------------
    def init_state(self, num_slots: int) -> None:
        self._text = torch.zeros(num_slots, self._max_text, dtype=torch.int64, device=self.device)
        self._n_text = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        if self.reference_sample_rate:
            dtype = self.lm.model.codec_embedding.weight.dtype if self.lm is not None else self.dtype
            self._clone = clone.CloneState(
                num_slots, self.hidden_size, self.max_ref_frames, dtype, self.device
            )

    def check_prompt(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
        prompt = rows[:, 2] >= q.PROMPT_TEXT
        frames = rows[~prompt]
        last_kind = q.PROMPT_REF if self.reference_sample_rate else q.PROMPT_BOTH
        if (rows[prompt, 2] > last_kind).any() or (rows[prompt, 0] >= q.TALKER_VOCAB).any():
            return "a prompt row's kind or codec id is out of range"
        if (frames[:, 0] >= q.TALKER_VOCAB).any() or (frames[:, 1:] >= q.CODE_VOCAB).any():
            return "a frame's code is out of range"
        names = {"text", "speaker", "codes"} if self.reference_sample_rate else {"text"}
        if set(state) - names:
            return f"{self.spec['name']} prompts carry only {sorted(names)} state; got {sorted(state)}"
        if self.reference_sample_rate:
            why = clone.check_state(self, rows, state)
            if why:
                return why
        text = state.get("text")
        if text is not None and (
            text.ndim != 1
            or text.dtype.kind != "i"
            or len(text) > self._max_text
            or (len(text) and (text.min() < 0 or text.max() >= self.text_vocab_size))
        ):
            return f"'text' state is a list of at most {self._max_text} text ids"
        return ""

    @property
    def _max_text(self) -> int:
        return int(self.spec["max_tokens"])

    def admit(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """The streaming text mode's text ids into the slot (none: every frame's text column is the
        tts pad row)."""
        from gpu_worker.runner.slots import to_device

        text = state.get("text", np.zeros(0, np.int64)).astype(np.int64)
        n = torch.tensor([len(text)], dtype=torch.int64)
        self._n_text[slot : slot + 1] = to_device(n, self.device)
        if len(text):
            self._text[slot, : len(text)] = to_device(torch.from_numpy(text), self.device)
        if self._clone is not None:
            self._clone.admit(slot, state)

    def codec_prefix(self, state: dict[str, np.ndarray]) -> np.ndarray | None:
        """An in-context clone's clip frames ("codes" [T, 16] int32), which its codec stream decodes
        first: the reference's `generate_voice_clone` decodes the clip's and the generated frames as
        one utterance and cuts the clip's audio off. None for every other prompt (x-vector-only
        cloning too: the reference decodes its frames alone)."""
        return state.get("codes")

    # --- appended text (programs/base.py, Appended text) -----------------------------------------
    @property
    def append_capacity(self) -> int:
        return self._max_text if self.appends_text else 0

    def take_text(self, text: str, final: bool) -> tuple[str, str]:
        """Split before the text's last pre-token (a word and the space before it, a run of spaces):
        the pre-tokens before it are whole whatever follows, and the BPE never merges across them,
        so the taken part's ids followed by those of the rest and what comes next are the ids of
        the whole text. The text comes back normalized (the tokenizer's normalizer, if any)."""
        if self._tokenizer is None:
            self.load_prompts()
        tok = self._tokenizer.tokenizer
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        if final or not text:
            return text, ""
        pieces = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer is not None else []
        cut = pieces[-1][1][0] if pieces else 0
        return text[:cut], text[cut:]

    def append(self, text: str) -> dict[str, np.ndarray]:
        """Taken text → {"text": [k] int32 its ids} (the streaming text mode's state)."""
        return {"text": np.asarray(self.text_ids(text) if text else [], dtype=np.int32)}

    def appended_rows(self, state: dict[str, np.ndarray]) -> int:
        text = state.get("text")
        return 0 if text is None else len(text)

    def check_append(self, state: dict[str, np.ndarray]) -> str:
        if set(state) - {"text"}:
            return f"an append carries only 'text' state; got {sorted(state)}"
        return self.check_prompt(np.zeros((0, q.N_CODEBOOKS), np.int64), state)

    def extend(self, slot: int, state: dict[str, np.ndarray], start: int) -> None:
        """The ids into the slot's text at [start, start + k), and its length (host → device copies
        queued after the step in flight, which reads only ids below `start`)."""
        from gpu_worker.runner.slots import to_device

        text = state.get("text", np.zeros(0, np.int64)).astype(np.int64)
        if not len(text):
            return
        end = start + len(text)
        self._text[slot, start:end] = to_device(torch.from_numpy(text), self.device)
        self._n_text[slot : slot + 1] = to_device(torch.tensor([end], dtype=torch.int64), self.device)

    def open_steps(self, n_rows: int) -> int:
        """Step k (k = 0 the prompt) feeds frame k - 1, whose text column is text id k: it needs
        n_rows > k while more text may come (at n_rows == k the column would read tts eos)."""
        return n_rows

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """[N, 16] rows → [N, H]: a prompt row is its text row (+ its codec row, or the request's
        speaker vector, or a frame of its clip: clone.py); a frame is its codebooks' embeddings plus
        its text column: text id step + 1 of the request's streaming text, the tts eos id right
        after it, else the tts pad id."""
        lm = self.lm
        kind = ids[:, 2]
        codes, speaker = ids, None
        if self._clone is not None:
            speaker, codes = self._clone.rows(ids, rows.slot)
        prompt = kind >= q.PROMPT_TEXT  # its text id in column 1
        framed = ~prompt | (kind == q.PROMPT_REF)  # its codec track a frame of 16 codes
        nxt = rows.step + 1
        n = self._n_text[rows.slot]
        held = self._text[rows.slot, nxt.clamp(0, self._text.shape[1] - 1)]
        column = torch.where(nxt < n, held, torch.where(nxt == n, q.TTS_EOS_ID, q.TTS_PAD_ID))
        text = lm.text_rows(torch.where(prompt, ids[:, 1], column))  # [N, H]
        frames = lm.frame_rows(torch.where(framed[:, None], codes, 0))  # [N, H]
        codec = lm.codec_rows(ids[:, 0]) * (kind == q.PROMPT_BOTH)[:, None].to(text.dtype)
        if speaker is not None:
            codec = codec + speaker
        return torch.where(framed[:, None], frames + text, text + codec)

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.lm.backbone(hidden, pos, attn)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] → [B, 1, 2049] codebook 0 over `head_ids` (the reference suppresses the rest)."""
        return (hidden @ self.head_weight.T).float()[:, None, :]

    def decode_tokens(
        self, hidden: torch.Tensor, c0: torch.Tensor, sample: Sampler, rows: Rows
    ) -> torch.Tensor:
        return self.lm.predict(hidden, c0, sample)  # [B, 16]

    def fuse_layers(self) -> bool:
        """The talker and the predictor in FlashInfer's kernels (`Qwen3TtsLM.fuse`), on a GPU in
        fp16/bf16 with FlashInfer installed."""
        half = self.lm.codec_head.weight.dtype in (torch.float16, torch.bfloat16)
        if self.device.type != "cuda" or not half or importlib.util.find_spec("flashinfer") is None:
            return False
        self.lm.fuse(max_positions=max(self.spec["max_tokens"], 4096))
        return True

    def compile_depth(self, enabled: bool = True) -> bool:
        """The predictor's positions as one compiled function (fused.py)."""
        self.lm.compile_predictor(enabled)
        return True

    # --- tokens → meaning ----------------------------------------------------------------------
    def classify(self, tokens: torch.Tensor, n_audio: torch.Tensor) -> torch.Tensor:
        stop = tokens[:, 0] == q.CODEC_EOS
        return torch.where(stop, int(TokenKind.STOP), int(TokenKind.AUDIO))

    # --- codec (graph) -------------------------------------------------------------------------
    def init_codec_streams(self, n_slots: int) -> None:
        self.codec.init_streams(n_slots)

    def prime_codec_streams(self, tokens: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """The clip's frames [B, P, 16] in one pass (`Qwen3TtsCodec.prime`), not in P / 8 passes."""
        self.codec.prime(tokens, slots)

    def detokenize(
        self,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        tail_rows: int = 0,
        streams: CodecStreams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, R, 16] frames continuing each entry's stream → audio [Bd, R * 1920], valid [Bd]
        (the decoder has no noise: keys unused)."""
        return _stream_audio(self.codec.decode_stream, tokens, streams)

    def compiled_detokenize(self, backend: str = "inductor"):
        """`detokenize` of streamed windows (any R frames) with the decoder under torch.compile
        (`Qwen3TtsCodec.compiled`)."""
        stream = self.codec.compiled(backend)

        def detokenize(
            tokens: torch.Tensor, keys: torch.Tensor, tail_rows: int = 0, streams: CodecStreams | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return _stream_audio(stream, tokens, streams)

        return detokenize

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def _instruction_rows(self, model_kwargs: dict[str, str]) -> list[list[int]]:
        instruct = (model_kwargs.get("instructions") or "").strip()
        if not instruct:
            return []
        if not self.spec.get("instructions", True):
            raise ValueError(f"{self.spec['name']} takes no instructions")
        if self._tokenizer is None:
            self.load_prompts()
        head = [q.IM_START_ID, *self._tokenizer.text_ids("user\n")]
        ids = [*head, *self._tokenizer.text_ids(instruct), q.IM_END_ID, *self._tokenizer.text_ids("\n")]
        return [_row(q.CODEC_PAD, i, q.PROMPT_TEXT) for i in ids]

    def option_rows(self, model_kwargs: dict[str, str], voice: Voice | None = None) -> int:
        """The instruction's rows; a voice's clip and transcript are within `prompt_overhead`."""
        return len(self._instruction_rows(model_kwargs))

    def prompt_overhead(self) -> int:
        """3 role rows, at most 4 think/language rows and a speaker row, pad+bos rows, the tts eos
        row and the last bos row."""
        if self.reference_sample_rate:  # and an in-context clip: its frames and transcript
            return 3 + 5 + 1 + 2 + self.max_ref_frames + int(self.spec["max_ref_text"])
        return 3 + 5 + 1 + 2

    def _codec_prefix(self, model_kwargs: dict[str, str]) -> list[int]:
        """The think / language / speaker / pad / bos codec ids of the reference's prompt."""
        voices = self.spec.get("voices") or []
        speaker = (model_kwargs.get("voice") or self.spec.get("default_voice") or "").lower()
        if voices and speaker not in q.SPEAKERS:
            raise ValueError(f"voice {speaker!r} is not one of {', '.join(voices)}")
        if not voices and model_kwargs.get("voice"):
            raise ValueError(f"{self.spec['name']} has no preset voices: describe the voice in instructions")
        ids = self.language_prefix(model_kwargs, q.SPEAKER_DIALECT.get(speaker) if voices else None)
        if voices:
            ids.append(q.SPEAKERS[speaker])
        return [*ids, q.CODEC_PAD, q.CODEC_BOS]

    def language_prefix(self, model_kwargs: dict[str, str], dialect: str | None = None) -> list[int]:
        """The think / language codec ids: `NOTHINK, THINK_BOS, THINK_EOS` for "auto", else
        `THINK, THINK_BOS, language, THINK_EOS` (a speaker's `dialect` for chinese or auto)."""
        language = (model_kwargs.get("language") or "auto").lower()
        if language != "auto" and (language not in q.LANGUAGES or "dialect" in language):
            raise ValueError(
                f"language {language!r} is not one of {', '.join(self.spec['languages'])} or auto"
            )
        lang_id = None if language == "auto" else q.LANGUAGES[language]
        if dialect and language in ("chinese", "auto"):
            lang_id = q.LANGUAGES[dialect]
        if lang_id is None:
            return [q.NOTHINK, q.THINK_BOS, q.THINK_EOS]
        return [q.THINK, q.THINK_BOS, lang_id, q.THINK_EOS]

    def text_ids(self, text: str) -> list[int]:
        """`text`'s ids as text (no control token from a client)."""
        if self._tokenizer is None:
            self.load_prompts()
        return self._tokenizer.text_ids(text)

    def role_ids(self) -> list[int]:
        """The assistant role's text ids: `<|im_start|>assistant\n`."""
        return [q.IM_START_ID, q.ASSISTANT_ID, *self.text_ids("\n")]

    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> PromptRows:
        if not text or not text.strip():
            raise ValueError("text is empty; give the text to speak")
        if self.reference_sample_rate:
            return clone.clone_rows(self, self.text_ids(text), model_kwargs, voice)
        if voice is not None:
            raise ValueError(
                f"{self.spec['name']} takes no reference audio; its voices are "
                + (", ".join(self.spec["voices"]) or "described in instructions")
            )
        unknown = sorted(set(model_kwargs) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"{self.spec['name']} takes the model options {', '.join(_OPTIONS)}; got {', '.join(unknown)}"
            )
        mode = (model_kwargs.get("non_streaming_mode") or "true").lower()
        if mode not in ("true", "false"):
            raise ValueError(f"non_streaming_mode is true or false, not {mode!r}")
        body = self.text_ids(text)
        codec = self._codec_prefix(model_kwargs)
        rows = self._instruction_rows(model_kwargs)
        rows += [_row(q.CODEC_PAD, i, q.PROMPT_TEXT) for i in (q.IM_START_ID, q.ASSISTANT_ID)]
        rows += [_row(q.CODEC_PAD, i, q.PROMPT_TEXT) for i in self._tokenizer.text_ids("\n")]
        # Codec rows before the last, on the tts pad row; the pad codec row on the tts bos row.
        rows += [_row(c, q.TTS_PAD_ID) for c in codec[:-2]] + [_row(q.CODEC_PAD, q.TTS_BOS_ID)]
        if mode == "true":
            rows += [_row(q.CODEC_PAD, t) for t in [*body, q.TTS_EOS_ID]] + [_row(q.CODEC_BOS, q.TTS_PAD_ID)]
            return PromptRows(np.asarray(rows, dtype=np.int32))
        rows.append(_row(q.CODEC_BOS, body[0]))
        return PromptRows(np.asarray(rows, dtype=np.int32), {"text": np.asarray(body, dtype=np.int32)})


def _row(codec: int, text: int, kind: int = q.PROMPT_BOTH) -> list[int]:
    return [codec, text, kind] + [0] * (q.N_CODEBOOKS - 3)


PROGRAM = Qwen3TtsProgram
