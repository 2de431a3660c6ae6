"""Validation of `POST /generate` and `POST /v1/audio/speech` bodies: pure functions from the decoded
fields to a request, driven by the field tables below (which /openapi.json also publishes).

Defaults come from the model's `ModelSpec` (announced by the tokenizer workers), so the gateway needs
neither torch nor `programs`. Texts may be
longer than one generation can speak: `gateway.segments` splits them; the limit here is
--max-text-chars on the whole input.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

import msgspec

from common.config import ServeConfig
from common.messages import ModelSpec, SamplingParams, VoiceFeatures
from gateway.encoders import available_formats, default_format
from gateway.fields import BadRequest, Field, FormFields, parse_fields, per_spec, show
from gateway.omni_fields import check_omni, language_option, omni_fields, ref_text_field, streaming_choice
from gateway.segments import MAX_TEXT_CHARS_LIMIT, segment_budget, split_text, text_limit

SEED_MAX = 2**63 - 1
_OPTION_MAX_CHARS = 4_000_000  # a model option may carry audio codes (a conversation context)

# OpenAI's model names, accepted for the served model so that OpenAI clients work unchanged.
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# Formats OpenAI offers that this build cannot produce, and why (the message tells the client).
UNSUPPORTED_FORMATS = {"aac": "libsndfile, which encodes the audio here, has no AAC encoder"}

__all__ = ["BadRequest", "GenerateParams", "SpeechParams", "parse_generate", "parse_speech"]


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    """A validated request, ready to be split into segments and submitted."""

    text: str
    voice: str
    sampling: SamplingParams
    streaming: bool
    segments: tuple[str, ...] = ()  # the text as generations (see gateway.segments)
    options: tuple[tuple[str, str], ...] = ()  # the model's own request options (ModelSpec.options)
    ref_audio: str = ""  # a reference clip as sent in a field: base64 or a data URL (gateway.clips)
    ref_text: str = ""  # what the reference clip says
    clone: VoiceFeatures | None = None  # the encoded clip or saved voice (gateway.cloning fills it)


@dataclasses.dataclass(frozen=True)
class SpeechParams(GenerateParams):
    """A validated OpenAI speech request: `GenerateParams` plus the output container and framing."""

    response_format: str = "wav"
    stream_format: str = "audio"  # "audio": raw bytes; "sse": speech.audio.delta events


# -- the field tables ----------------------------------------------------------------------------------


def max_tokens_limit(spec: ModelSpec, cfg: ServeConfig) -> int:
    """The largest `max_tokens` a request may ask for (prompt included, as in the reference)."""
    limit = spec.max_tokens
    if cfg.gpu.max_context > 0:
        limit = min(limit, cfg.gpu.max_context)
    if cfg.gpu.num_pages > 0:
        # The gpu_worker reserves KV pages for a request's whole budget (+1 token) before it starts:
        # a budget larger than the whole cache could never start, and would block the queue behind it.
        limit = min(limit, max(1, (cfg.gpu.num_pages - 1) * cfg.gpu.page_size - 1))
    return limit


def _text_field(name: str, cfg: ServeConfig) -> Field:
    return Field(
        name,
        "string",
        "The text to speak, a non-empty string. Text longer than one generation can speak is split "
        "at sentence ends and spoken as consecutive segments.",
        required=True,
        max_length=text_limit(cfg),
        max_length_hint=f"the server's --max-text-chars, at most {MAX_TEXT_CHARS_LIMIT}; send longer texts in parts",
    )


# OpenAI's voice names. Clients written for OpenAI's speech API can send no other (Pipecat's
# OpenAITTSService only these; LiveKit's plugin defaults to "ash"), so /v1/audio/speech takes each
# as an alias of one of the model's voices (`voice_aliases`).
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
)


@per_spec
def voice_aliases(spec: ModelSpec) -> dict[str, str]:
    """OpenAI's voice names → the model's voices, in order and round again (alloy → the first, ash →
    the second, …); a name the model has as a voice of its own stays that voice."""
    voices = list(spec.voices)
    if not voices:
        return {}
    return {name: voices[i % len(voices)] for i, name in enumerate(OPENAI_VOICES) if name not in voices}


def voice_field(spec: ModelSpec, aliases: bool = False, saved: tuple[str, ...] = ()) -> Field:
    """`voice`: one of the model's voices, OpenAI's aliases of them (`aliases`), or a voice saved
    for the model (`saved`, POST /v1/audio/voices)."""
    voices = tuple(spec.voices)
    extra = tuple(voice_aliases(spec)) if aliases else ()
    aka = ", or one of OpenAI's voice names, each an alias of one of them (GET /v1/models)" if extra else ""
    return Field(
        "voice",
        "string",
        f"One of the model's voices{aka}"
        + (", or a saved voice." if spec.reference_sample_rate > 0 else "."),
        default=spec.default_voice or None,
        choices=voices + extra + tuple(n for n in saved if n not in voices + extra),
        choice_error="unknown voice {value}; this model's voices are: {choices}",
    )


def option_fields(spec: ModelSpec, skip: set[str] = frozenset()) -> list[Field]:
    """The model's own string options (ModelSpec.options: name → description), passed through
    to its prompt builder as model_kwargs, which checks them (a ValueError there is a 400); those
    named in `skip` are fields of the endpoint already (their value is passed through the same)."""
    return [
        Field(name, "string", description, max_length=_OPTION_MAX_CHARS, max_length_hint="send less context")
        for name, description in spec.options.items()
        if name not in skip
    ]


def _options(
    v: Mapping[str, Any], spec: ModelSpec, extra: tuple[str, ...] = ()
) -> tuple[tuple[str, str], ...]:
    """The model options a request set: the spec's, then the OpenAI fields in `extra` the model
    does not refuse (as strings)."""
    names = [*spec.options, *(n for n in extra if n not in spec.refused)]
    return tuple((n, str(v[n])) for n in names if v[n] is not None)


def sampling_fields(spec: ModelSpec, cfg: ServeConfig) -> list[Field]:
    """Sampling options, shared by both endpoints (extra fields on the OpenAI one)."""
    d = spec.sampling
    limit = max_tokens_limit(spec, cfg)
    return [
        Field(
            "temperature",
            "number",
            "Sampling temperature; 0 = greedy.",
            d.temperature,
            minimum=0,
            maximum=2,
        ),
        Field(
            "top_p",
            "number",
            "Nucleus sampling mass.",
            d.top_p,
            minimum=0,
            maximum=1,
            exclusive_minimum=True,
        ),
        Field(
            "top_k",
            "integer",
            "Keep the k likeliest tokens; 0 = off.",
            d.top_k,
            minimum=0,
            maximum=spec.vocab_size,
        ),
        Field(
            "min_p",
            "number",
            "Drop tokens below min_p x the top probability; 0 = off.",
            d.min_p,
            minimum=0,
            maximum=1,
        ),
        Field(
            "repetition_penalty",
            "number",
            "Penalty on tokens already in the prompt or generated.",
            d.repetition_penalty,
            minimum=0,
            maximum=10,
            exclusive_minimum=True,
        ),
        Field(
            "seed",
            "integer",
            "Fixes the tokens and the codec's noise: the same seed gives the same audio. Segment k of a "
            "long text uses seed + k. Default: random.",
            minimum=0,
            maximum=SEED_MAX,
        ),
        Field(
            "max_tokens",
            "integer",
            "Token budget of each generation (each segment of a long text), prompt included.",
            limit,
            minimum=1,
            maximum=limit,
        ),
        Field(
            "min_tokens",
            "integer",
            "The stop token is masked until this many tokens were generated; at most max_tokens.",
            0,
            minimum=0,
            maximum=limit,
        ),
    ]


@per_spec
def generate_fields(spec: ModelSpec, cfg: ServeConfig, saved: tuple[str, ...] = ()) -> list[Field]:
    """The fields of `POST /generate`, in the order error messages list them (the reference clip,
    a multipart file `audio`, is read apart: gateway.body)."""
    streaming = Field(
        "streaming",
        "boolean",
        "true: chunked WAV with unknown sizes (0xFFFFFFFF), PCM16 as it is decoded; false: one complete WAV.",
        True,
    )
    return [
        _text_field("text", cfg),
        voice_field(spec, saved=saved),
        streaming,
        *sampling_fields(spec, cfg),
        *([ref_text_field(spec)] if spec.reference_sample_rate > 0 else []),
        *option_fields(spec, skip={"ref_text"}),
    ]


def accepted_models(spec: ModelSpec) -> list[str]:
    """Names a speech request may give for the served model: the served name, the registry's other
    names for the same model (ModelSpec.aliases), and OpenAI's model names."""
    names = [spec.name, *spec.aliases]
    return names + [n for n in OPENAI_MODEL_ALIASES if n not in names]


def _speed_field(spec: ModelSpec) -> Field:
    why = spec.refused.get("speed")
    if why is None:  # the model takes a speaking rate: OpenAI's range, passed on as a model option
        return Field("speed", "number", "Speaking rate.", 1.0, minimum=0.25, maximum=4.0)
    return Field(
        "speed", "number", f"Speaking rate. {why}, so only 1.0 is accepted.", 1.0, minimum=1.0, maximum=1.0
    )


def _instructions_field(spec: ModelSpec) -> Field:
    why = spec.refused.get("instructions")
    if why is None:  # the model takes them: passed on as a model option
        return Field("instructions", "string", "Voice instructions.", max_length=_OPTION_MAX_CHARS)
    return Field(
        "instructions",
        "string",
        f"Voice instructions; {why}, so it must be empty.",
        max_length=0,
        max_length_hint="this model takes no instructions: leave the field out",
    )


@per_spec
def speech_fields(spec: ModelSpec, cfg: ServeConfig, saved: tuple[str, ...] = ()) -> list[Field]:
    """The fields of `POST /v1/audio/speech`: OpenAI's, then voxpipe's extras."""
    formats = tuple(available_formats(spec.sample_rate))
    models = tuple(accepted_models(spec))
    omni = omni_fields(spec)
    return [
        Field(
            "model",
            "string",
            f"The served model, {spec.name}, or an alias of it (see GET /v1/models).",
            required=True,
            choices=models,
        ),
        _text_field("input", cfg),
        voice_field(spec, aliases=True, saved=saved),
        Field(
            "response_format",
            "string",
            "Audio container: pcm is raw 16-bit little-endian mono samples at the model's sample rate; "
            "flac is sent whole when generation ends (its header holds the length).",
            default_format(spec.sample_rate),
            choices=formats,
            choice_error="unsupported response_format {value}; use one of: {choices}",
        ),
        _speed_field(spec),
        Field(
            "stream_format",
            "string",
            "audio: the encoded bytes, chunked as they are produced; sse: text/event-stream of "
            "speech.audio.delta events (base64 audio) and a final speech.audio.done.",
            "audio",
            choices=("audio", "sse"),
        ),
        _instructions_field(spec),
        Field(
            "streaming",
            "boolean",
            "voxpipe extension. false: one complete file with exact sizes (stream_format audio only).",
            True,
        ),
        *omni,
        *sampling_fields(spec, cfg),
        *option_fields(spec, skip={f.name for f in omni}),
    ]


# -- parsing -------------------------------------------------------------------------------------------


def parse_generate(
    body: Mapping[str, Any], spec: ModelSpec, cfg: ServeConfig, saved: tuple[str, ...] = ()
) -> GenerateParams:
    """Check every field of a /generate `body` against the model `spec` and the deployment `cfg`
    (`saved`: the voices saved for the model, which `voice` may name).

    A field given as JSON `null` counts as absent (its default applies), except `text`.
    """
    fields = generate_fields(spec, cfg, saved)
    v = parse_fields(body, fields)
    sampling = sampling_params(v, fields, spec, cfg)
    return GenerateParams(
        text=v["text"],
        voice=v["voice"] or field_default(fields, "voice") or "",
        sampling=sampling,
        streaming=True if v["streaming"] is None else v["streaming"],
        segments=plan_segments(v["text"], sampling.max_tokens, spec, cfg),
        options=_options(v, spec),
        ref_text=v.get("ref_text") or "",
    )


def parse_speech(
    body: Mapping[str, Any], spec: ModelSpec, cfg: ServeConfig, saved: tuple[str, ...] = ()
) -> SpeechParams:
    """Check an OpenAI speech `body` (`saved` as in parse_generate). A model that is not served is
    a 404 (`model_not_found`)."""
    form = isinstance(body, FormFields)
    fields = speech_fields(spec, cfg, saved)
    models = _default_choices(fields, "model")
    model = body.get("model")
    if isinstance(model, str):
        match = next((m for m in models if m.lower() == model.lower()), None)  # names are case-blind
        if match is None:
            raise BadRequest(
                f"model {show(model)} is not served here; this server serves {spec.name} "
                f"(accepted names: {', '.join(models)}); see GET /v1/models",
                param="model",
                code="model_not_found",
                status=404,
            )
        body = {**body, "model": match}
    fmt = body.get("response_format")
    if isinstance(fmt, str) and fmt in UNSUPPORTED_FORMATS:
        choices = ", ".join(available_formats(spec.sample_rate))
        raise BadRequest(
            f"response_format {fmt!r} is not supported: {UNSUPPORTED_FORMATS[fmt]}; use one of: {choices}",
            param="response_format",
            code="unsupported_value",
        )
    body = check_omni(body, spec)
    speed = body.get("speed")
    if speed is not None and "speed" in spec.refused:
        try:
            next(f for f in fields if f.name == "speed").parse(speed, form)
        except BadRequest:
            raise BadRequest(
                f"field 'speed' must be 1.0, got {show(speed)}: {spec.refused['speed']}; leave speed out "
                "(or resample the audio on your side)",
                param="speed",
                code="unsupported_value",
            ) from None
    v = parse_fields(FormFields(body) if form else body, fields)
    stream_format = v["stream_format"] or "audio"
    streaming = streaming_choice(v)
    if not streaming and stream_format == "sse":
        raise BadRequest(
            "stream_format 'sse' always streams; drop streaming: false or use stream_format 'audio'",
            param="streaming",
        )
    sampling = sampling_params(v, fields, spec, cfg)
    voice = v["voice"] or field_default(fields, "voice") or ""
    return SpeechParams(
        text=v["input"],
        voice=voice_aliases(spec).get(voice, voice),
        sampling=sampling,
        segments=plan_segments(v["input"], sampling.max_tokens, spec, cfg),
        options=_options(v, spec, extra=("speed", "instructions")) + language_option(v),
        streaming=streaming,
        response_format=v["response_format"] or field_default(fields, "response_format"),
        stream_format=stream_format,
        ref_audio=v["ref_audio"] or "",
        ref_text=v["ref_text"] or "",
    )


def plan_segments(
    text: str, max_tokens: int, spec: ModelSpec, cfg: ServeConfig, option_rows: int = 0
) -> tuple[str, ...]:
    """The text's segments, sized for the model's full token budget (see `gateway.segments`) less
    the prompt rows the request's model options add (`option_rows`, from the tokenizer pool).

    A request's `max_tokens` then caps each segment's generation. When the text is split, it must
    leave every segment room for its prompt (at most one token per byte) and one codec window of
    audio: cutting every sentence short is never what a client of a long text wants."""
    budget = segment_budget(spec, max_tokens_limit(spec, cfg) - option_rows)
    segments = tuple(split_text(text, budget))
    if len(segments) <= 1:
        return (text,)  # one generation: the text as the client sent it
    longest = max(len(s.encode("utf-8")) for s in segments)
    need = spec.prompt_overhead + option_rows + longest + spec.window_rows
    if max_tokens < need:
        raise BadRequest(
            f"max_tokens={max_tokens} is too small for this text: it is spoken as {len(segments)} "
            f"segments of up to {longest} bytes, and each generation needs up to {need} tokens for its "
            f"prompt and first audio; raise max_tokens to at least {need} or leave it out",
            param="max_tokens",
        )
    return segments


def field_default(fields: list[Field], name: str) -> Any:
    return next(f.default for f in fields if f.name == name)


def _default_choices(fields: list[Field], name: str) -> tuple[str, ...]:
    return next(f.choices or () for f in fields if f.name == name)


def sampling_params(
    v: Mapping[str, Any], fields: list[Field], spec: ModelSpec, cfg: ServeConfig
) -> SamplingParams:
    """SamplingParams from the parsed values, the spec's defaults filling the gaps."""
    sampling: dict[str, Any] = msgspec.structs.asdict(spec.sampling)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if v[name] is not None:
            sampling[name] = v[name]
    sampling["seed"] = random.getrandbits(63) if v["seed"] is None else v["seed"]
    sampling["max_tokens"] = max_tokens_limit(spec, cfg) if v["max_tokens"] is None else v["max_tokens"]
    if v["min_tokens"] is not None and v["min_tokens"] > sampling["max_tokens"]:
        # The bound depends on this request's max_tokens: re-check with it, for the same message.
        min_field = next(f for f in fields if f.name == "min_tokens")
        dataclasses.replace(min_field, maximum=sampling["max_tokens"]).parse(v["min_tokens"])
    sampling["min_tokens"] = spec.sampling.min_tokens if v["min_tokens"] is None else v["min_tokens"]
    sampling["constrained"] = spec.constrained if cfg.gateway.constrained is None else cfg.gateway.constrained
    return SamplingParams(**sampling)
