"""Validation of a `POST /generate` body: a pure function from the decoded fields to a request.

Bodies come from JSON (typed values) or from HTML forms (every value a string), so each field
parser accepts both: `0.7` and `"0.7"`, `false` and `"no"`. Every problem raises `BadRequest` with
a message that names the field, what was given and what is allowed; the server turns it into a
400. Defaults come from the model spec (`programs.<x>.spec`), so the gateway needs no torch.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from typing import Any

from common.config import ServeConfig
from common.messages import SamplingParams

# Request fields a client may set; anything else is rejected so typos do not pass silently.
FIELDS = (
    "text",
    "voice",
    "streaming",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
)

# Used when the spec does not say how large the vocabulary is; any larger k means "all tokens".
TOP_K_MAX = 1_000_000
SEED_MAX = 2**63 - 1

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class BadRequest(ValueError):
    """The client's body is invalid; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    """A validated request, ready to become a `GenerateRequest`."""

    text: str
    voice: str
    sampling: SamplingParams
    streaming: bool


def parse_generate(body: Mapping[str, Any], spec: Mapping[str, Any], cfg: ServeConfig) -> GenerateParams:
    """Check every field of `body` against the model `spec` and the deployment `cfg`.

    A field given as JSON `null` counts as absent (its default applies), except `text`.
    """
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        hint = ""
        if any(k.lstrip().startswith("{") for k in unknown):
            hint = " (a JSON body needs the header Content-Type: application/json)"
        raise BadRequest(f"unknown field {names}{hint}; accepted fields: {', '.join(FIELDS)}")

    def get(name: str) -> Any:
        return body.get(name)

    text = _text(get("text"), cfg.max_text_chars)
    voice = _voice(get("voice"), spec)
    streaming = True if get("streaming") is None else _bool("streaming", get("streaming"))

    defaults = spec.get("sampling", {})
    # Only fields SamplingParams has: a spec may carry extra knobs other processes read.
    sampling: dict[str, Any] = {k: v for k, v in defaults.items() if k in SamplingParams.__struct_fields__}

    def override(name: str, value: Any) -> None:
        if value is not None:
            sampling[name] = value

    override("temperature", _number("temperature", get("temperature"), 0.0, 2.0))
    override("top_p", _number("top_p", get("top_p"), 0.0, 1.0, lo_open=True))
    top_k_max = int(spec.get("vocab_size") or TOP_K_MAX)
    override("top_k", _integer("top_k", get("top_k"), 0, top_k_max))
    override("min_p", _number("min_p", get("min_p"), 0.0, 1.0))
    override(
        "repetition_penalty",
        _number("repetition_penalty", get("repetition_penalty"), 0.0, 10.0, lo_open=True),
    )

    seed = _integer("seed", get("seed"), 0, SEED_MAX)
    sampling["seed"] = random.getrandbits(63) if seed is None else seed

    limit = max_tokens_limit(spec, cfg)
    max_tokens = _integer("max_tokens", get("max_tokens"), 1, limit)
    sampling["max_tokens"] = limit if max_tokens is None else max_tokens
    min_tokens = _integer("min_tokens", get("min_tokens"), 0, sampling["max_tokens"])
    sampling["min_tokens"] = 0 if min_tokens is None else min_tokens

    sampling["constrained"] = bool(
        spec.get("constrained", False) if cfg.constrained is None else cfg.constrained
    )
    return GenerateParams(text=text, voice=voice, sampling=SamplingParams(**sampling), streaming=streaming)


def max_tokens_limit(spec: Mapping[str, Any], cfg: ServeConfig) -> int:
    """The largest `max_tokens` a request may ask for (prompt included, as in the reference)."""
    limit = int(spec["max_tokens"])
    if cfg.max_context > 0:
        limit = min(limit, cfg.max_context)
    return limit


def _text(value: Any, max_chars: int) -> str:
    if value is None:
        raise BadRequest("field 'text' is required: the text to speak, a non-empty string")
    if not isinstance(value, str):
        raise BadRequest(f"field 'text' must be a string, got {_show(value)}")
    if not value.strip():
        raise BadRequest("field 'text' is empty; give the text to speak")
    if len(value) > max_chars:
        raise BadRequest(
            f"field 'text' has {len(value)} characters; the limit is {max_chars} "
            "(split the text, or raise --max-text-chars)"
        )
    return value


def _voice(value: Any, spec: Mapping[str, Any]) -> str:
    voices = list(spec.get("voices", []))
    if value is None:
        return str(spec.get("default_voice", voices[0] if voices else ""))
    if not isinstance(value, str) or value not in voices:
        raise BadRequest(f"unknown voice {_show(value)}; this model's voices are: {', '.join(voices)}")
    return value


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise BadRequest(f"field {name!r} must be a boolean (true/false, 1/0, yes/no), got {_show(value)}")


def _to_float(name: str, value: Any, expected: str) -> float:
    # bool is an int subclass, but `"temperature": true` is a client bug, not a number.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadRequest(f"field {name!r} must be {expected}, got {_show(value)}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise BadRequest(f"field {name!r} must be {expected}, got {_show(value)}") from None
    if not math.isfinite(number):
        raise BadRequest(f"field {name!r} must be a finite number ({expected}), got {_show(value)}")
    return number


def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """A float in [lo, hi] (or (lo, hi] with `lo_open`); None when absent."""
    if value is None:
        return None
    allowed = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    number = _to_float(name, value, allowed)
    if number < lo or number > hi or (lo_open and number == lo):
        raise BadRequest(f"field {name!r} must be {allowed}, got {_show(value)}")
    return number


def _integer(name: str, value: Any, lo: int, hi: int) -> int | None:
    """An integer in [lo, hi]; integral floats (`50.0`) pass. None when absent."""
    if value is None:
        return None
    allowed = f"an integer in [{lo}, {hi}]"
    if isinstance(value, int) and not isinstance(value, bool):
        number = value  # exact: large seeds must not round-trip through float
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value.strip())
    else:
        as_float = _to_float(name, value, allowed)
        if not as_float.is_integer():
            raise BadRequest(f"field {name!r} must be {allowed}, got {_show(value)}")
        number = int(as_float)
    if number < lo or number > hi:
        raise BadRequest(f"field {name!r} must be {allowed}, got {_show(value)}")
    return number


def _show(value: Any) -> str:
    """A short, JSON-like rendering of a client's value for error messages."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."
