"""Qwen3-TTS Base's voice cloning: the reference clip's encoders and the cloned prompt's rows.

Based on the reference's `Qwen3TTSModel.create_voice_clone_prompt` / `generate_voice_clone` and
`Qwen3TTSForConditionalGeneration.generate` / `generate_icl_prompt` (qwen-tts-compat 0.1.1.post1).

Encoders (codec_worker, `encode_references`): a batch of 24 kHz clips → per clip
{"speaker": [D] float32, the ECAPA-TDNN x-vector (programs/qwen3_tts/speaker.py), D the talker's
width; "codes": [T, 16] int32, the 12 Hz tokenizer's encoder codes (programs/blocks/mimi_encoder.py,
its first 16 codebooks, T = ceil(samples / 1920))}.

Prompt (tokenizer_worker, `clone_rows`): the CustomVoice prompt (programs/qwen3_tts/program.py)
with the speaker's x-vector where a preset speaker's codec row goes, and, in ICL mode (the
default; `x_vector_only_mode` "true" leaves it out), the clip in context: its transcript's text
rows and its frames, as the reference lays them out:

- the text track L = ref text ids + text ids, then tts eos (T1 = len(L) + 1 rows); the codec track
  codec bos, then the clip's frames (T2 = 1 + T rows, a frame the sum of its 16 codebooks' embeddings);
- non-streaming text: each text row + the codec pad row, then each codec row + the tts pad row;
  frames then carry the tts pad row;
- streaming text (the reference's default for cloning): the two tracks summed row by row, the
  shorter one filled with tts pad rows; text rows past T2 enter one per frame (the "text" state).

Rows cannot hold a float vector or a 16-code frame beside a text id, so both travel as per-request
state (programs/base.py): "speaker" [D] float32, "codes" [T, 16] int32. A speaker row is
`[0, TTS_PAD_ID, PROMPT_SPEAKER, 0…]`, a clip frame row `[j, text id, PROMPT_REF, 0…]` (frame j of
"codes"); `embed` reads both from the request's slot. The "codes" also prime the request's codec
stream (`codec_prefix`): the reference decodes the clip's frames and the generated ones as one
utterance and cuts the clip's audio off.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import PromptRows, Reference, Voice
from programs.qwen3_tts import spec as q

if TYPE_CHECKING:
    from programs.qwen3_tts.program import Qwen3TtsProgram

OPTIONS = ("language", "non_streaming_mode", "x_vector_only_mode")


# --- encoders (codec_worker) -------------------------------------------------------------------
class Encoders:
    """The speaker encoder and the 12 Hz tokenizer's encoder, float32 on the codec's device."""

    def __init__(self, program: Qwen3TtsProgram) -> None:
        from programs.blocks.mimi_encoder import MimiEncoder
        from programs.blocks.weights import checkpoint_dir, load_safetensors, random_weights
        from programs.qwen3_tts.speaker import SpeakerEncoder

        dev = program.device
        self.speaker = SpeakerEncoder(program.read_config("lm_config")["speaker_encoder_config"]).to(dev)
        if program.load_format == "dummy" or program.weights is None:
            random_weights(self.speaker, dev, seed=0)
        else:
            path, _ = checkpoint_dir(program.weights)
            loaded = load_safetensors(
                path, dev, self.speaker.load_weights, keep=lambda n: n.startswith("speaker_encoder.")
            )
            missing = {n for n, _ in self.speaker.named_parameters()} - loaded
            if missing:
                raise ValueError(f"{program.weights}: no speaker encoder weights, e.g. {sorted(missing)[:3]}")
        self.speaker.eval()
        if program.load_format == "dummy" or program.codec_weights is None:
            with open(program.config_path("codec_config")) as f:
                tok = json.load(f)
            n_q = tok["encoder_valid_num_quantizers"]
            self.codes = MimiEncoder.from_config(tok["encoder_config"], torch.float32, dev, n_q=n_q)
        else:
            self.codes = MimiEncoder.from_pretrained(program.codec_weights, torch.float32, dev)
        if self.codes.n_q != q.N_CODEBOOKS or self.codes.hop != q.SAMPLES_PER_FRAME:
            raise ValueError(
                f"the 12 Hz encoder gives {q.N_CODEBOOKS} codes per {q.SAMPLES_PER_FRAME} samples"
            )
        self.device = dev

    def encode(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Each clip's {"speaker": [D] float32, "codes": [T, 16] int32}, the clips as one batch."""
        for i, clip in enumerate(clips):
            if len(clip.audio) < q.SAMPLES_PER_FRAME:
                raise ValueError(f"reference clip {i} is shorter than one frame (80 ms)")
        lengths = torch.tensor([len(c.audio) for c in clips], dtype=torch.int64)
        audio = torch.zeros(len(clips), int(lengths.max()), dtype=torch.float32)
        for i, clip in enumerate(clips):
            audio[i, : len(clip.audio)] = torch.from_numpy(np.asarray(clip.audio, dtype=np.float32))
        audio = audio.to(self.device)
        speaker = self.speaker.embed(audio, lengths).cpu().numpy()
        codes, frames = self.codes.encode(audio, lengths)
        codes, frames = codes.cpu().numpy().astype(np.int32), frames.cpu().tolist()
        return [{"speaker": speaker[i], "codes": codes[i, : frames[i]]} for i in range(len(clips))]


# --- prompt rows (tokenizer_worker) ------------------------------------------------------------
def _row(codec: int, text: int, kind: int = q.PROMPT_BOTH) -> list[int]:
    return [codec, text, kind] + [0] * (q.N_CODEBOOKS - 3)


def clone_rows(
    program: Qwen3TtsProgram, body: list[int], model_kwargs: dict[str, str], voice: Voice | None
) -> PromptRows:
    """The cloned prompt for the text ids `body` (see the module docstring)."""
    unknown = sorted(set(model_kwargs) - set(OPTIONS) - {"voice"})
    if unknown:
        raise ValueError(
            f"{program.spec['name']} takes the model options {', '.join(OPTIONS)}; got {', '.join(unknown)}"
        )
    if voice is None:
        raise ValueError(
            f"{program.spec['name']} clones a voice: give a reference clip (ref_audio, and ref_text "
            "for in-context cloning) or a saved voice's name"
        )
    streaming = _flag(model_kwargs, "non_streaming_mode", "false") == "false"
    xvec_only = _flag(model_kwargs, "x_vector_only_mode", "false") == "true"
    speaker = _speaker(program, voice)
    codec = program.language_prefix(model_kwargs)  # think / language ids
    rows = [_row(q.CODEC_PAD, i, q.PROMPT_TEXT) for i in program.role_ids()]
    rows += [_row(c, q.TTS_PAD_ID) for c in codec] + [_row(0, q.TTS_PAD_ID, q.PROMPT_SPEAKER)]
    rows.append(_row(q.CODEC_PAD, q.TTS_BOS_ID))
    state: dict[str, np.ndarray] = {"speaker": speaker}
    if xvec_only:  # the CustomVoice layout after the speaker
        if not streaming:
            rows += [_row(q.CODEC_PAD, t) for t in [*body, q.TTS_EOS_ID]] + [_row(q.CODEC_BOS, q.TTS_PAD_ID)]
        else:
            rows.append(_row(q.CODEC_BOS, body[0]))
            state["text"] = np.asarray(body, dtype=np.int32)
        return PromptRows(np.asarray(rows, dtype=np.int32), state)
    codes = _codes(program, voice)
    if not voice.text.strip():
        raise ValueError(
            "in-context cloning needs the clip's transcript (ref_text); without one set "
            "x_vector_only_mode to true"
        )
    ref_ids = program.text_ids(voice.text)
    if len(ref_ids) > int(program.spec["max_ref_text"]):
        raise ValueError(
            f"ref_text is {len(ref_ids)} tokens; in-context cloning takes at most {program.spec['max_ref_text']}"
        )
    text = [*ref_ids, *body]  # L: the clip's words, then the text to speak
    t1, t2 = len(text) + 1, 1 + len(codes)
    state["codes"] = codes
    if not streaming:
        rows += [_row(q.CODEC_PAD, t) for t in [*text, q.TTS_EOS_ID]] + [_row(q.CODEC_BOS, q.TTS_PAD_ID)]
        rows += [_row(j, q.TTS_PAD_ID, q.PROMPT_REF) for j in range(len(codes))]
        return PromptRows(np.asarray(rows, dtype=np.int32), state)
    column = [*text, q.TTS_EOS_ID] + [q.TTS_PAD_ID] * max(0, t2 - t1)
    rows.append(_row(q.CODEC_BOS, column[0]))
    rows += [_row(j, column[j + 1], q.PROMPT_REF) for j in range(len(codes))]
    if t1 > t2:  # frame j's text column: text[t2 + j], then tts eos (`embed` reads index j + 1)
        state["text"] = np.asarray(text[t2 - 1 :], dtype=np.int32)
    return PromptRows(np.asarray(rows, dtype=np.int32), state)


def _flag(model_kwargs: dict[str, str], name: str, default: str) -> str:
    value = (model_kwargs.get(name) or default).lower()
    if value not in ("true", "false"):
        raise ValueError(f"{name} is true or false, not {value!r}")
    return value


def _speaker(program: Qwen3TtsProgram, voice: Voice) -> np.ndarray:
    vec = voice.features.get("speaker")
    if vec is None or vec.shape != (program.hidden_size,) or not np.isfinite(vec).all():
        raise ValueError(f"the voice has no {program.hidden_size}-wide speaker vector; encode its clip again")
    return np.asarray(vec, dtype=np.float32)


def _codes(program: Qwen3TtsProgram, voice: Voice) -> np.ndarray:
    codes = voice.features.get("codes")
    limit = program.max_ref_frames
    if codes is None or codes.ndim != 2 or codes.shape[1] != q.N_CODEBOOKS or len(codes) == 0:
        raise ValueError("the voice has no reference codes; encode its clip again")
    if len(codes) > limit:
        raise ValueError(
            f"the reference clip is {len(codes) / q.FRAME_RATE:.1f} s; in-context cloning takes at most "
            f"{limit / q.FRAME_RATE:.0f} s (a shorter clip, or x_vector_only_mode true)"
        )
    if codes.min() < 0 or codes.max() >= q.CODE_VOCAB:
        raise ValueError("the voice's reference codes are out of range; encode its clip again")
    return np.asarray(codes, dtype=np.int32)


# --- per-request state (gpu_worker) ------------------------------------------------------------
def check_state(program: Qwen3TtsProgram, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
    """Why a cloned prompt's speaker / codes state (and the rows reading it) is wrong, or ""."""
    kind = rows[:, 2]
    speaker, codes = state.get("speaker"), state.get("codes")
    if (kind == q.PROMPT_SPEAKER).any() != (speaker is not None):
        return "a speaker row comes with 'speaker' state, and 'speaker' state with a speaker row"
    if speaker is not None and (
        speaker.dtype.kind != "f" or speaker.shape != (program.hidden_size,) or not np.isfinite(speaker).all()
    ):
        return f"'speaker' state is {program.hidden_size} finite floats"
    ref = kind == q.PROMPT_REF
    if codes is None:
        return "a reference frame row needs 'codes' state" if ref.any() else ""
    if (
        codes.dtype.kind != "i"
        or codes.ndim != 2
        or codes.shape[1] != q.N_CODEBOOKS
        or not 0 < len(codes) <= program.max_ref_frames
        or codes.min() < 0
        or codes.max() >= q.CODE_VOCAB
    ):
        return f"'codes' state is [T <= {program.max_ref_frames}, {q.N_CODEBOOKS}] codes"
    if ref.any() and (rows[ref, 0].min() < 0 or rows[ref, 0].max() >= len(codes)):
        return "a reference frame row names a frame past 'codes'"
    return ""


class CloneState:
    """Each slot's speaker vector [S, H] (LM dtype) and reference frames [S, F, 16] int64."""

    def __init__(
        self, num_slots: int, hidden: int, max_frames: int, dtype: torch.dtype, device: torch.device
    ):
        self.speaker = torch.zeros(num_slots, hidden, dtype=dtype, device=device)
        self.codes = torch.zeros(num_slots, max_frames, q.N_CODEBOOKS, dtype=torch.int64, device=device)

    def admit(self, slot: int, state: dict[str, Any]) -> None:
        from gpu_worker.runner.slots import to_device

        if "speaker" in state:
            vec = torch.from_numpy(np.array(state["speaker"], dtype=np.float32))
            self.speaker[slot] = to_device(vec, self.speaker.device).to(self.speaker.dtype)
        if "codes" in state:
            codes = torch.from_numpy(np.array(state["codes"], dtype=np.int64))
            self.codes[slot, : len(codes)] = to_device(codes, self.codes.device)

    def rows(self, ids: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph-safe: → (each row's slot speaker vector [N, H] where the row is a speaker row, else
        0; the codes of each row's frame [N, 16]: the clip frame a reference row names, else ids)."""
        kind = ids[:, 2]
        speaker = self.speaker[slot] * (kind == q.PROMPT_SPEAKER)[:, None].to(self.speaker.dtype)
        frame = self.codes[slot, ids[:, 0].clamp(0, self.codes.shape[1] - 1)]  # [N, 16]
        return speaker, torch.where((kind == q.PROMPT_REF)[:, None], frame, ids)
