"""Input streaming by segmentation: text that arrives in pieces, cut into segments as soon as each
can be spoken, and the fields that open a WebSocket session (`gateway.websocket`).

A `Segmenter` buffers appended text and hands out a segment when

- a sentence ends (`. ! ? …` and closing quotes before whitespace, `。！？`, a line break: the rule of
  `gateway.segments`; a full stop at the very end of the buffer waits for the next character, since
  "3." may go on as "3.5"),
- the buffer holds `max_words` complete words without a sentence end (cut after the last clause
  mark among them when it leaves at least half of them, else after the last complete word),
- the client flushes or ends its input (everything buffered).

Each piece is then cut by `split_text` to the byte budget one generation can speak, so a segment
always fits its generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from common.config import ServeConfig
from common.messages import ModelSpec, SamplingParams
from gateway.fields import BadRequest, Field, parse_fields, show
from gateway.segments import CLAUSE_END, SENTENCE_END, segment_budget, split_text
from gateway.validation import (
    accepted_models,
    field_default,
    max_tokens_limit,
    option_fields,
    sampling_fields,
    sampling_params,
    voice_aliases,
    voice_field,
)

MAX_WORDS = 12  # complete words buffered without a sentence end before they are spoken
SESSION_FORMATS = ("pcm",)


class Segmenter:
    """Appended text → segments ready to speak (see the module docstring). `budget`: UTF-8 bytes
    one generation can speak (`gateway.segments.segment_budget`)."""

    def __init__(self, budget: int, max_words: int = MAX_WORDS) -> None:
        self.budget = budget
        self.max_words = max_words
        self.buffer = ""

    def append(self, text: str) -> list[str]:
        """Buffer `text`; returns the segments it completes (often none)."""
        self.buffer += text
        return self._take(self._cut())

    def flush(self) -> list[str]:
        """Everything buffered, as segments."""
        return self._take(len(self.buffer))

    def clear(self) -> None:
        self.buffer = ""

    def _cut(self) -> int:
        """Where the part of the buffer that can be spoken now ends (0: none)."""
        end = 0
        for m in SENTENCE_END.finditer(self.buffer):
            if m.start() > 0:
                end = m.end()
        rest = self.buffer[end:]
        words = rest.split()
        complete = len(words) if rest[-1:].isspace() else len(words) - 1
        if complete < self.max_words:
            return end
        last_space = len(rest.rstrip()) if rest[-1:].isspace() else len(rest) - len(words[-1])
        clause = 0
        for m in CLAUSE_END.finditer(rest, 0, last_space):
            if len(rest[: m.start()].split()) >= self.max_words // 2:
                clause = m.end()
        return end + (clause or last_space)

    def _take(self, cut: int) -> list[str]:
        piece, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return split_text(piece, self.budget) if piece.strip() else []


@dataclasses.dataclass(frozen=True)
class SessionParams:
    """A validated `session` message."""

    model: str
    voice: str
    sampling: SamplingParams
    response_format: str
    budget: int  # UTF-8 bytes of text one segment may hold
    options: tuple[tuple[str, str], ...] = ()


def session_fields(spec: ModelSpec, cfg: ServeConfig) -> list[Field]:
    """The fields of a WebSocket `session` message (besides `type` and `api_key`)."""
    return [
        Field(
            "model",
            "string",
            f"The served model, {spec.name}, or an alias of it (see GET /v1/models).",
            required=True,
            choices=tuple(accepted_models(spec)),
        ),
        voice_field(spec, aliases=True),
        Field(
            "response_format",
            "string",
            "Audio of the binary frames: pcm, 16-bit little-endian mono samples at the model's sample rate.",
            "pcm",
            choices=SESSION_FORMATS,
            choice_error="unsupported response_format {value} on a WebSocket session; use one of: {choices}",
        ),
        *sampling_fields(spec, cfg),
        # Options that add prompt rows (a conversation context) would need sizing per segment.
        *option_fields(spec, skip=set(spec.sized_options)),
    ]


def parse_session(body: Mapping[str, Any], spec: ModelSpec, cfg: ServeConfig) -> SessionParams:
    """Check a `session` message's fields (`type` and `api_key` already taken out); raises
    BadRequest naming the field."""
    fields = session_fields(spec, cfg)
    model = body.get("model")
    if isinstance(model, str):  # model names are case-blind, as on /v1/audio/speech
        match = next((m for m in accepted_models(spec) if m.lower() == model.lower()), None)
        if match is None:
            raise BadRequest(
                f"model {show(model)} is not served here; this server serves {spec.name}",
                param="model",
                code="model_not_found",
            )
        body = {**body, "model": match}
    v = parse_fields(body, fields)
    sampling = sampling_params(v, fields, spec, cfg)
    voice = v["voice"] or field_default(fields, "voice") or ""
    names = [f.name for f in option_fields(spec, skip=set(spec.sized_options))]
    return SessionParams(
        model=spec.name,
        voice=voice_aliases(spec).get(voice, voice),
        sampling=sampling,
        response_format=v["response_format"] or "pcm",
        budget=segment_budget(spec, max_tokens_limit(spec, cfg)),
        options=tuple((n, str(v[n])) for n in names if v[n] is not None),
    )
