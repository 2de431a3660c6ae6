"""The request fields of every endpoint, as one table that both validation and /openapi.json read.

A `Field` says a field's JSON type, its limits (bounds, choices, length) and its documented
default; `Field.parse` checks one value against them and `Field.schema` describes them as JSON
Schema, so the OpenAPI document cannot drift from what the gateway accepts. Limits that depend on
the model or the deployment (voices, max_tokens, --max-text-chars) are filled in by the table
builders in `gateway.validation`.

Bodies come from JSON (typed values) or HTML forms (every value a string, a `FormFields`). A JSON
value must have its field's JSON type, as /openapi.json states it: `0.7` for a number, `false` for a
boolean; `"0.7"`, `"no"` and `null` are refused. A form's strings are read by the field's type, so
`"0.7"` and `"no"` pass there. Every problem raises `BadRequest` with a message that names the
field, what was given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

R = TypeVar("R")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


# Tables remembered per model spec (`per_spec`): more are a sign of specs built per request.
PER_SPEC_MAX = 16


def per_spec(build: Callable[..., R]) -> Callable[..., R]:
    """`build(spec, *rest)` (a field table, the voice aliases) remembered for the very objects it was
    built from: the gateway keeps one spec object while the model's facts stay the same
    (`Pipeline.learn`) and one config, so each request reads the table built for the first one
    (a speech request's tables take ~50 us to build, a burst's intake runs them hundreds of times).
    `spec` and the objects among `rest` match by identity (the memo holds them, so no other object
    takes their id), tuples of names (the saved voices) by value. The result is shared: callers
    only read it."""
    memo: dict[tuple, tuple[tuple, R]] = {}

    @functools.wraps(build)
    def remembered(spec: Any, *rest: Any) -> R:
        args = (spec, *rest)
        key = tuple(a if isinstance(a, tuple) else id(a) for a in args)
        hit = memo.get(key)
        if hit is not None:
            return hit[1]
        if len(memo) >= PER_SPEC_MAX:
            memo.clear()
        value = build(spec, *rest)
        memo[key] = (args, value)
        return value

    remembered.memo = memo  # type: ignore[attr-defined]

    return remembered


class BadRequest(ValueError):
    """The client's body is invalid; the message says what to change.

    `status` is the HTTP status (400, or 404 for a model that is not served); `param` and `code`
    fill the OpenAI error shape on /v1 endpoints."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400
    ):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


class FormFields(dict):
    """A body's fields as an HTML form sends them: every value a string, read by its field's type."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field: its type, limits and documented default.

    `type` is a JSON Schema type: "string", "number", "integer" or "boolean". Bounds are inclusive
    unless `exclusive_minimum`. `choices` restricts a string (or a boolean) to a list;
    `choice_error` is the message for a value outside it (`{value}` and `{choices}` are filled in).
    """

    name: str
    type: str
    description: str
    default: Any = None  # documented default (None: none, or computed per request)
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[Any, ...] | None = None
    choice_error: str = ""
    max_length: int | None = None
    max_length_hint: str = ""  # appended to the too-long message: which setting raises the limit

    def parse(self, value: Any, form: bool = False) -> Any:
        """The checked value (never None: absent fields are the caller's business). `form`: the
        value is a form's string, read by the field's type; otherwise it must have that JSON type."""
        if self.type == "string":
            return self._string(value)
        if self.type == "boolean":
            flag = _bool(self.name, value, form)
            if self.choices is not None and flag not in self.choices:
                shown = ", ".join("true" if c else "false" for c in self.choices)
                message = self.choice_error or "field {name!r} must be one of {choices}, got {value}"
                raise BadRequest(
                    message.format(name=self.name, choices=shown, value=show(flag)),
                    param=self.name,
                    code="unsupported_value",
                )
            return flag
        if self.type == "integer":
            return _integer(self.name, value, int(self.minimum or 0), int(self.maximum or 0), form)
        return _number(
            self.name, value, float(self.minimum or 0), float(self.maximum or 0), self.exclusive_minimum, form
        )

    def _string(self, value: Any) -> str:
        if self.choices is not None:
            if not isinstance(value, str) or value not in self.choices:
                message = self.choice_error or "field {name!r} must be one of {choices}, got {value}"
                raise BadRequest(
                    message.format(name=self.name, choices=", ".join(self.choices), value=show(value)),
                    param=self.name,
                )
            return value
        if not isinstance(value, str):
            raise BadRequest(f"field {self.name!r} must be a string, got {show(value)}", param=self.name)
        if self.required and not value.strip():
            raise BadRequest(f"field {self.name!r} is empty; give the text to speak", param=self.name)
        if self.max_length is not None and len(value) > self.max_length:
            raise BadRequest(
                f"field {self.name!r} has {len(value)} characters; the limit is {self.max_length}"
                + (f" ({self.max_length_hint})" if self.max_length_hint else ""),
                param=self.name,
            )
        return value

    def schema(self) -> dict[str, Any]:
        """This field as a JSON Schema (OpenAPI 3.1) property."""
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.choices is not None:
            out["enum"] = list(self.choices)
        if self.minimum is not None:
            out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = _plain(self.minimum, self.type)
        if self.maximum is not None:
            out["maximum"] = _plain(self.maximum, self.type)
        if self.type == "string" and self.required:
            out["minLength"] = 1
        if self.max_length is not None:
            out["maxLength"] = self.max_length
        if self.default is not None:
            out["default"] = self.default
        return out


def parse_fields(body: Mapping[str, Any], fields: Sequence[Field]) -> dict[str, Any]:
    """Every field's checked value (None when absent), after refusing unknown fields, missing
    required ones and JSON nulls (a field left out takes its default; null is no value of any
    field's type). A `FormFields` body's strings are read by each field's type."""
    by_name = {f.name: f for f in fields}
    unknown = sorted(k for k in body if k not in by_name)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        hint = ""
        if any(k.lstrip().startswith("{") for k in unknown):
            hint = " (a JSON body needs the header Content-Type: application/json)"
        raise BadRequest(
            f"unknown field {names}{hint}; accepted fields: {', '.join(by_name)}",
            param=unknown[0],
            code="unknown_parameter",
        )
    form = isinstance(body, FormFields)
    nulls = [f.name for f in fields if f.name in body and body[f.name] is None]
    if nulls:
        raise BadRequest(
            f"field {nulls[0]!r} is null; leave the field out to take its default",
            param=nulls[0],
        )
    values: dict[str, Any] = {}
    for f in fields:
        value = body.get(f.name)
        if value is None:
            if f.required:
                what = f.description.split(". ")[0].rstrip(".")  # its first sentence says what it is
                raise BadRequest(
                    f"field {f.name!r} is required: {what[0].lower()}{what[1:]}",
                    param=f.name,
                    code="missing_required_parameter",
                )
            values[f.name] = None
        else:
            values[f.name] = f.parse(value, form)
    return values


def schema_of(fields: Sequence[Field]) -> dict[str, Any]:
    """A JSON Schema object with one property per field."""
    out: dict[str, Any] = {
        "type": "object",
        "properties": {f.name: f.schema() for f in fields},
        "additionalProperties": False,
    }
    required = [f.name for f in fields if f.required]
    if required:
        out["required"] = required
    return out


def _plain(x: float, kind: str) -> int | float:
    return int(x) if kind == "integer" or float(x).is_integer() else x


def _bool(name: str, value: Any, form: bool = True) -> bool:
    if isinstance(value, bool):
        return value
    if not form:
        raise BadRequest(f"field {name!r} must be a boolean (true or false), got {show(value)}", param=name)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise BadRequest(
        f"field {name!r} must be a boolean (true/false, 1/0, yes/no), got {show(value)}", param=name
    )


def _to_float(name: str, value: Any, expected: str, form: bool) -> float:
    # bool is an int subclass, but `"temperature": true` is a client bug, not a number.
    if isinstance(value, str) and not form:
        raise BadRequest(
            f"field {name!r} must be {expected}, got the string {show(value)}: a JSON body gives "
            "numbers without quotes",
            param=name,
        )
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadRequest(f"field {name!r} must be {expected}, got {show(value)}", param=name)
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise BadRequest(f"field {name!r} must be {expected}, got {show(value)}", param=name) from None
    if not math.isfinite(number):
        raise BadRequest(
            f"field {name!r} must be a finite number ({expected}), got {show(value)}", param=name
        )
    return number


def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False, form: bool = False) -> float:
    """A float in [lo, hi] (or (lo, hi] with `lo_open`)."""
    allowed = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    number = _to_float(name, value, allowed, form)
    if number < lo or number > hi or (lo_open and number == lo):
        raise BadRequest(f"field {name!r} must be {allowed}, got {show(value)}", param=name)
    return number


def _integer(name: str, value: Any, lo: int, hi: int, form: bool = False) -> int:
    """An integer in [lo, hi]; integral floats (`50.0`) pass."""
    allowed = f"an integer in [{lo}, {hi}]"
    if isinstance(value, int) and not isinstance(value, bool):
        number = value  # exact: large seeds must not round-trip through float
    elif form and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value.strip())
    else:
        as_float = _to_float(name, value, allowed, form)
        if not as_float.is_integer():
            raise BadRequest(f"field {name!r} must be {allowed}, got {show(value)}", param=name)
        number = int(as_float)
    if number < lo or number > hi:
        raise BadRequest(f"field {name!r} must be {allowed}, got {show(value)}", param=name)
    return number


def show(value: Any) -> str:
    """A short, JSON-like rendering of a client's value for error messages."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (str, int, float)):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."
