"""Chatterbox program (ResembleAI/chatterbox): T3, a Llama LM of S3 speech tokens conditioned on a
voice, sampled with classifier-free guidance. See programs/chatterbox/spec.py for the facts and the
prompt's ids, model.py for the LM.

The contract pieces it uses (programs/base.py):
- classifier-free guidance (`guidance`): a prompt is the conditional prompt then the unconditional
  one (its text rows in the UNCOND_TEXT range: positions without token embeddings), and `guide`
  samples from cond + w·(cond − uncond) with the request's `cfg_weight` w;
- per-request state: the voice (speaker embedding [256], prompt speech tokens [T <= 150]), the
  `exaggeration`, the guidance weight and the text's row count. `admit` runs the conditioning
  encoder (speaker projection, perceiver, emotion projection) once per request into the slot's
  COND_ROWS rows, which `embed` reads for the prompt's conditioning rows;
- an output head over the speech ids only (`head_ids`): prompt ids above them (text, conditioning)
  fall outside the repetition penalty, which sees the start of speech and the generated tokens, as
  the reference's.

- reference audio: `encode_references` (clone.py) turns a 16 kHz clip into the speaker embedding
  and prompt speech tokens that `preprocess` puts in the state in place of the default voice's;
- codec streams: S3Gen (codec.py) decodes each request's windows of 25 speech tokens in its codec
  slot, in the default voice's S3Gen conditioning, its noise from the request's key.

Request options (model_kwargs): `exaggeration` (default 0.5) and `cfg_weight` (default 0.5). The voice
is the checkpoint's default (conds.pt; random for dummy weights) or a cloned one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from programs.base import Attention, CodecStreams, LMProgram, PromptRows, Reference, Rows, Voice
from programs.blocks import fp8
from programs.chatterbox import spec as c

if TYPE_CHECKING:
    from programs.chatterbox.codec import S3Gen
    from programs.chatterbox.model import T3LM

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_STATE = {"speaker", "prompt_tokens", "exaggeration", "cfg_weight", "text_rows"}
# S3Gen's part of a cloned voice (clone.py), in the state of a request in a cloned voice.
S3GEN_VOICE = ("s3gen_tokens", "s3gen_mel", "s3gen_xvector")


def punc_norm(text: str) -> str:
    """The reference's text clean-up (tts.py `punc_norm`): a capital first letter, single spaces,
    uncommon punctuation replaced, and a full stop where the text ends without one."""
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in (
        ("...", ", "),
        ("…", ", "),
        (":", ","),
        (" - ", ", "),
        (";", ", "),
        ("—", "-"),
        ("–", "-"),
        (" ,", ","),
        ("“", '"'),
        ("”", '"'),
        ("‘", "'"),
        ("’", "'"),
    ):
        text = text.replace(old, new)
    text = text.rstrip(" ")
    return text if text.endswith((".", "!", "?", "-", ",")) else text + "."


def _option(model_kwargs: dict[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = model_kwargs.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], not {value}")
    return value


class ChatterboxProgram(LMProgram):
    config_dir = CONFIG_DIR
    name = "chatterbox"
    guidance = True
    codec_streams = True  # S3Gen keeps each request's tokens so far (programs/chatterbox/codec.py)
    codec_voices = True  # and the voice each speaks in: a cloned voice's S3Gen conditioning
    # A window costs ~3.7 TFLOP (10 guided flow steps over the prompt and the context): a call of 16
    # costs 16 windows' time, so a lone stream decodes in calls of one; a pass holds at most 16
    # windows (~2 s of the H200 in float32, ~16k kernels a window in a bucket's graph). See
    # docs/models/chatterbox.md, "Cost".
    codec_call_batch = 1
    codec_max_batch = 16
    # A window's work barely grows with its tokens (the flow runs over the prompt and the context
    # whatever the window holds), so after the first two seconds the windows decode in groups of
    # 2, then 4 (4 s of audio for about one window's work). Merged by a fixed schedule, never by
    # timing: S3Gen's attention sees the whole window, so the grouping shapes the audio
    # (programs/base.py, "Window groups").
    codec_merge = (2, 4)
    detok_groups = (1, 2, 4)
    reference_sample_rate = 16000  # the voice encoder's and the S3 tokenizer's rate (clone.py)

    def __init__(self, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.lm: T3LM | None = None
        self.codec: S3Gen | None = None
        self._tokenizer = None
        self._voice: dict[str, np.ndarray] | None = None  # the default voice (load_prompts)
        cfg = self.read_config("lm_config")
        self.config = cfg
        self.vocab_size = c.INPUT_VOCAB
        self.num_layers = cfg["num_hidden_layers"]
        self.num_qo_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.hidden_size = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_qo_heads
        self.max_text_rows = cfg["max_text_tokens"] + 2
        # Groups that a stream window holds in any voice (the tiny config's 40 tokens hold none).
        from programs.chatterbox.codec import window_room

        codec = self.read_config("codec_config")
        self.voice_tokens = codec.get("voice_tokens", codec["prompt_tokens"])
        self.s3gen_dims = (codec["flow"]["mels"], codec["flow"]["xvector_dim"])
        room = window_room(codec)
        fits = tuple(m for m in type(self).codec_merge if m * self.detok_interval <= room)
        self.codec_merge, self.detok_groups = fits, (1, *fits) if fits else ()

    # --- loading -------------------------------------------------------------------------------
    def load_lm(self) -> None:
        from programs.chatterbox.model import T3LM

        self.lm = self.lm_weights(T3LM)
        if self.quantization == "fp8":  # the backbone's GEMMs row-invariant (T3LM.quantize_fp8)
            self.lm.quantize_fp8()
        self.head_ids = torch.arange(c.SPEECH_VOCAB, device=self.device)

    def load_codec(self) -> None:
        """S3Gen (codec.py) in `codec_dtype` with the default voice's conditioning: the checkpoint's
        `s3gen.safetensors` and `conds.pt`, or random weights and a seeded random voice."""
        from programs.chatterbox.codec import S3Gen

        self.codec = self.codec_model(S3Gen)

    def load_prompts(self) -> None:
        """The text tokenizer (the checkpoint's tokenizer.json; a byte-level stand-in for random
        weights) and the default voice (the checkpoint's conds.pt; a seeded random one)."""
        if self.load_format == "dummy" or self.weights is None:
            gen = np.random.default_rng(0)
            speaker = gen.standard_normal(c.SPEAKER_DIM).astype(np.float32)
            self._voice = {
                "speaker": speaker / np.linalg.norm(speaker),
                "prompt_tokens": gen.integers(0, c.SPEECH_CODES, c.PROMPT_TOKENS).astype(np.int32),
            }
            return
        from huggingface_hub import snapshot_download
        from tokenizers import Tokenizer

        path = self.weights
        if not os.path.isdir(path):
            path = snapshot_download(path, allow_patterns=["conds.pt", "tokenizer.json"])
        self._tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        t3 = torch.load(os.path.join(path, "conds.pt"), map_location="cpu", weights_only=True)["t3"]
        self._voice = {
            "speaker": t3["speaker_emb"].reshape(-1).float().numpy(),
            "prompt_tokens": t3["cond_prompt_speech_tokens"].reshape(-1).numpy().astype(np.int32),
        }

    def load_encoders(self) -> None:
        """The voice encoder, the S3 tokenizer and CAMPPlus (clone.py, xvector.py): `ve.safetensors`
        and the `tokenizer.` and `speaker_encoder.` weights of `s3gen.safetensors`, or seeded random
        weights."""
        from programs.chatterbox.clone import S3Tokenizer, VoiceEncoder
        from programs.chatterbox.xvector import speaker_encoder

        self._speaker_encoder = VoiceEncoder()
        self._speech_tokenizer = S3Tokenizer(self.spec.get("s3_tokenizer"))
        if self.load_format == "dummy" or self.codec_weights is None:
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for module in (self._speaker_encoder, self._speech_tokenizer):
                    for name, t in module.named_parameters():
                        fill = 1.0 if name.endswith("ln.weight") else 0.0
                        t.copy_(torch.randn(t.shape, generator=gen) * 0.05 + fill)
            self._xvector_encoder = speaker_encoder(seed=2)
        else:
            from huggingface_hub import snapshot_download
            from safetensors.torch import load_file

            path = self.codec_weights
            if not os.path.isdir(path):
                path = snapshot_download(path, allow_patterns=["ve.safetensors", "s3gen.safetensors"])
            self._speaker_encoder.load_state_dict(load_file(os.path.join(path, "ve.safetensors")))
            s3gen = load_file(os.path.join(path, "s3gen.safetensors"))
            tok = {k[len("tokenizer.") :]: v for k, v in s3gen.items() if k.startswith("tokenizer.")}
            tok = {k: v for k, v in tok.items() if k not in ("_mel_filters", "window")}
            self._speech_tokenizer.load_state_dict(tok)
            self._xvector_encoder = speaker_encoder(s3gen)
        for module in (self._speaker_encoder, self._speech_tokenizer, self._xvector_encoder):
            module.to(self.device).eval()

    def encode_references(self, clips: list[Reference]) -> list[dict[str, np.ndarray]]:
        """Each 16 kHz clip's conditioning (ChatterboxTTS.prepare_conditionals): T3's `speaker` [256]
        float32 and `prompt_tokens` [<= 150] int32 (the clip's first 6 s), and S3Gen's
        (`S3Gen.embed_ref` of its first 10 s): `s3gen_tokens` [P] int32, their 24 kHz mel
        `s3gen_mel` [2P, 80] and the CAMPPlus x-vector `s3gen_xvector` [192], P cut to the codec's
        `voice_tokens` (the shipped config's 250 is 10 s: no cut)."""
        from programs.chatterbox.clone import s3gen_voice

        out = []
        for clip in clips:
            tokens = self._speech_tokenizer.tokens(clip.audio)
            if not len(tokens):
                raise ValueError("the reference clip is too short for a speech token (40 ms)")
            voice = s3gen_voice(clip.audio, self._speech_tokenizer, self._xvector_encoder)
            p = min(len(voice["s3gen_tokens"]), self.voice_tokens)
            voice["s3gen_tokens"], voice["s3gen_mel"] = voice["s3gen_tokens"][:p], voice["s3gen_mel"][: 2 * p]
            out.append({"speaker": self._speaker_encoder.embed(clip.audio), "prompt_tokens": tokens, **voice})
        return out

    # --- per-request state ---------------------------------------------------------------------
    def init_state(self, num_slots: int) -> None:
        dev, h = self.device, self.hidden_size
        self._cond = torch.zeros(num_slots, c.COND_ROWS, h, dtype=self.dtype, device=dev)
        self._weight = torch.zeros(num_slots, dtype=torch.float32, device=dev)
        self._text_end = torch.zeros(num_slots, dtype=torch.int64, device=dev)

    def check_prompt(self, rows: np.ndarray, state: dict[str, np.ndarray]) -> str:
        if set(state) not in (_STATE, _STATE | set(S3GEN_VOICE)):
            return (
                f"{self.spec['name']} prompts carry the state {sorted(_STATE)}, and a cloned voice's "
                f"{list(S3GEN_VOICE)}; got {sorted(state)}"
            )
        if S3GEN_VOICE[0] in state:
            error = self._s3gen_voice_error(state)
            if error:
                return error
        shapes = {"speaker": (c.SPEAKER_DIM,), "exaggeration": (1,), "cfg_weight": (1,), "text_rows": (1,)}
        if any(state[k].shape != s for k, s in shapes.items()):
            return f"state shapes must be {shapes}"
        tokens, n_text = state["prompt_tokens"], int(state["text_rows"][0])
        if tokens.ndim != 1 or not 1 <= len(tokens) <= c.PROMPT_TOKENS:
            return f"'prompt_tokens' holds 1 to {c.PROMPT_TOKENS} speech tokens"
        if tokens.min() < 0 or tokens.max() >= c.SPEECH_CODES:
            return "'prompt_tokens' are speech tokens below 6561"
        if not np.isfinite(state["speaker"]).all() or not np.isfinite(state["exaggeration"]).all():
            return "'speaker' and 'exaggeration' are finite"
        if not 0.0 <= float(state["cfg_weight"][0]) <= 2.0:
            return "'cfg_weight' lies in [0, 2]"
        if not 2 <= n_text <= self.max_text_rows:
            return f"'text_rows' lies in [2, {self.max_text_rows}]"
        if rows.shape != (2 * (c.COND_ROWS + n_text + 2), 1):
            return "rows are the conditional then the unconditional prompt of 'text_rows' text rows"
        text = rows[c.COND_ROWS : c.COND_ROWS + n_text, 0] - c.TEXT
        if text.min() < 0 or text.max() >= c.TEXT_VOCAB or not np.array_equal(rows[:, 0], self._rows(text)):
            return "rows are not the conditional then the unconditional prompt of their text"
        return ""

    def admit(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """The request's conditioning rows (computed on the device now), guidance weight and text
        end into `slot`."""
        from gpu_worker.runner.slots import to_device

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.from_numpy(np.array(a)).to(dtype), self.device)

        rows = self.lm.cond_rows(
            dev(state["speaker"], torch.float32),
            dev(state["prompt_tokens"], torch.int64),
            dev(state["exaggeration"], torch.float32),
        )
        self._cond[slot] = rows
        self._weight[slot : slot + 1] = dev(state["cfg_weight"], torch.float32)
        self._text_end[slot : slot + 1] = dev(state["text_rows"] + 2, torch.int64)

    def codec_voice(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """A cloned voice's S3Gen conditioning (its prompt tokens, their mel, the x-vector); None
        for the default voice."""
        return {k: state[k] for k in S3GEN_VOICE} if S3GEN_VOICE[0] in state else None

    def _s3gen_voice_error(self, features: dict[str, np.ndarray]) -> str:
        """Why a voice's S3Gen arrays are not what clone.py encodes ("" when they are)."""
        tokens, mel, xvector = (features[k] for k in S3GEN_VOICE)
        mels, dim = self.s3gen_dims
        if tokens.ndim != 1 or not 1 <= len(tokens) <= self.voice_tokens:
            return f"'s3gen_tokens' holds 1 to {self.voice_tokens} speech tokens"
        if tokens.min() < 0 or tokens.max() >= c.SPEECH_CODES:
            return f"'s3gen_tokens' are speech tokens below {c.SPEECH_CODES}"
        if mel.shape != (2 * len(tokens), mels) or xvector.shape != (dim,):
            return f"'s3gen_mel' is [2 P, {mels}] for P tokens and 's3gen_xvector' [{dim}]"
        if not (np.isfinite(mel).all() and np.isfinite(xvector).all()):
            return "'s3gen_mel' and 's3gen_xvector' are finite"
        if np.abs(mel).max() > 30 or np.abs(xvector).max() > 1e3:  # float16 holds them (log mels lie in ±12)
            return "'s3gen_mel' lies within ±30 and 's3gen_xvector' within ±1000"
        return ""

    # --- LM step (graph) -----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """[N, 1] → [N, H]: a speech id's embedding plus its speech position (prompt rows 0,
        generated token k at k + 1); a text id's embedding (zero in the unconditional prompt) plus
        its text position; a conditioning row from the request's slot."""
        lm, i = self.lm, ids[:, 0]
        step, slot = rows.step, rows.slot
        speech_pos = (step + 1).clamp(0, lm.speech_pos_emb.emb.weight.shape[0] - 1)
        speech = lm.speech_emb(i.clamp(0, c.SPEECH_VOCAB - 1)) + lm.speech_pos_emb.emb.weight[speech_pos]
        t = (i - c.TEXT).clamp(0, 2 * c.TEXT_VOCAB - 1)
        keep = (t < c.TEXT_VOCAB).to(speech.dtype)[:, None]
        text_pos = (step + self._text_end[slot]).clamp(0, self.max_text_rows - 1)
        text = lm.text_emb(t % c.TEXT_VOCAB) * keep + lm.text_pos_emb.emb.weight[text_pos]
        cond = self._cond[slot, (i - c.COND).clamp(0, c.COND_ROWS - 1)]
        out = torch.where((i < c.SPEECH_VOCAB)[:, None], speech, text)
        return torch.where((i >= c.COND)[:, None], cond, out)

    def backbone(self, hidden: torch.Tensor, pos: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.lm.backbone(hidden, pos, attn)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] → [B, 1, SPEECH_VOCAB] (head_ids), in GEMMs of 64 rows: a row's logits have the
        same bits whatever the step's row count (`fp8.tiled_linear`; the backbone's GEMMs are
        row-invariant with `--quantization fp8`)."""
        return fp8.tiled_linear(hidden, self.lm.speech_head.weight)[:, None, :]

    def guide(self, logits: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """[B, 2, 1, V] → cond + w·(cond − uncond) [B, 1, V], w the request's cfg_weight."""
        cond, uncond = logits[:, 0], logits[:, 1]
        return cond + self._weight[slot][:, None, None] * (cond - uncond)

    # --- codec (graph) -------------------------------------------------------------------------
    def init_codec_streams(self, n_slots: int) -> None:
        self.codec.init_streams(n_slots)

    def set_codec_voice(self, slot: int, voice: dict[str, torch.Tensor] | None) -> None:
        """Slot `slot`'s stream speaks in the cloned voice's S3Gen conditioning, or the default."""
        if voice is None:
            self.codec.set_stream_voice(slot, None)
            return
        tokens, mel, xvector = (voice[k] for k in S3GEN_VOICE)
        self.codec.set_stream_voice(slot, (tokens.long(), mel.T, xvector))

    def detokenize(
        self,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        tail_rows: int = 0,
        streams: CodecStreams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, R, 1] S3 tokens continuing each entry's stream → audio [Bd, 960 R], valid [Bd]
        (always: every window has audio). The stream's noise comes from its first window's key."""
        ids = tokens[:, :, 0].clamp(0, c.SPEECH_CODES - 1)
        audio = self.codec.decode_stream(ids, keys, streams.slot, streams.fresh)
        return audio.float().clamp(-1, 1), torch.ones(len(ids), dtype=torch.bool, device=ids.device)

    # --- prompts (tokenizer_worker) ------------------------------------------------------------
    def text_ids(self, text: str) -> list[int]:
        """The text's token ids (the reference's EnTokenizer: spaces as [SPACE]); the stand-in maps
        each UTF-8 byte to an id in [1, 255)."""
        if self._tokenizer is None:
            return [1 + b % 254 for b in text.encode()]
        return self._tokenizer.encode(text.replace(" ", "[SPACE]")).ids

    def _rows(self, text: np.ndarray) -> np.ndarray:
        """Both prompts' ids [2R] for the text rows `text` (start and stop of text included)."""
        cond_rows = c.COND + np.arange(c.COND_ROWS)
        speech = np.full(2, c.START_SPEECH)
        cond = np.concatenate([cond_rows, c.TEXT + text, speech])
        uncond = np.concatenate([cond_rows, c.UNCOND_TEXT + text, speech])
        return np.concatenate([cond, uncond]).astype(np.int64)

    def preprocess(self, text: str, model_kwargs: dict[str, str], voice: Voice | None = None) -> PromptRows:
        unknown = set(model_kwargs) - set(self.spec["model_options"]) - {"voice"}
        if unknown:
            raise ValueError(
                f"unknown model options {sorted(unknown)}; {self.spec['name']} takes "
                f"{sorted(self.spec['model_options'])}"
            )
        if model_kwargs.get("voice"):
            raise ValueError(f"{self.spec['name']} has no preset voices; it speaks in its default voice")
        if self._voice is None:
            self.load_prompts()
        features = self._voice if voice is None else self._voice_features(voice)
        if not text.strip():
            raise ValueError("text is empty")
        exaggeration = _option(model_kwargs, "exaggeration", 0.5, 0.0, 2.0)
        weight = _option(model_kwargs, "cfg_weight", 0.5, 0.0, 2.0)
        ids = [c.START_TEXT, *self.text_ids(punc_norm(text)), c.STOP_TEXT]
        if len(ids) > self.max_text_rows:
            raise ValueError(f"text is {len(ids)} tokens, more than {self.max_text_rows}")
        state = {
            **features,
            "exaggeration": np.array([exaggeration], np.float32),
            "cfg_weight": np.array([weight], np.float32),
            "text_rows": np.array([len(ids)], np.int32),
        }
        return PromptRows(self._rows(np.array(ids, np.int64))[:, None].astype(np.int32), state)

    def _voice_features(self, voice: Voice) -> dict[str, np.ndarray]:
        """A cloned voice's `encode_references` features, checked: ValueError → HTTP 400. A voice
        without S3Gen's part (features of T3's encoders alone) speaks in the default voice's timbre."""
        f = voice.features
        speaker, tokens = f.get("speaker"), f.get("prompt_tokens")
        if speaker is None or tokens is None or speaker.shape != (c.SPEAKER_DIM,) or tokens.ndim != 1:
            raise ValueError("the voice is not a Chatterbox voice (speaker [256], prompt_tokens)")
        if not 1 <= len(tokens) <= c.PROMPT_TOKENS or tokens.min() < 0 or tokens.max() >= c.SPEECH_CODES:
            raise ValueError(f"the voice's prompt tokens are 1 to {c.PROMPT_TOKENS} speech tokens")
        out = {"speaker": speaker.astype(np.float32), "prompt_tokens": tokens.astype(np.int32)}
        if any(k in f for k in S3GEN_VOICE):
            if not all(k in f for k in S3GEN_VOICE):
                raise ValueError(f"the voice's S3Gen part is {list(S3GEN_VOICE)}; got {sorted(f)}")
            error = self._s3gen_voice_error(f)
            if error:
                raise ValueError(f"the voice's {error}")
            out.update({k: f[k].astype(np.int32 if k == "s3gen_tokens" else np.float32) for k in S3GEN_VOICE})
        return out

    def prompt_overhead(self) -> int:
        """One prompt's rows besides the text's (the budget counts the conditional prompt's rows,
        programs.base: Classifier-free guidance): conditioning, start and stop of text, two starts
        of speech; a text of b bytes adds at most b rows (the tokenizer's ids span a character
        or more)."""
        return c.COND_ROWS + 4

    def option_rows(self, model_kwargs: dict[str, str], voice: Voice | None = None) -> int:
        return 0


PROGRAM = ChatterboxProgram
