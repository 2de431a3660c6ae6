"""Reading a request body into a field dict: JSON objects and HTML forms (urlencoded or multipart).

Kept apart from validation so that `validation.parse_generate` stays a pure function of the fields;
this module owns everything about bytes on the wire: content types, size limits, UTF-8, JSON syntax.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from gateway.fields import FormFields

MAX_BODY_BYTES = 1 << 20  # the Application's client_max_size; a text request needs far less

JSON_TYPES = ("application/json",)
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


class BodyError(Exception):
    """A body the gateway cannot read; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_fields(request: web.Request, timeout_s: float) -> dict[str, Any]:
    """The body's fields: a JSON object as decoded, or a form's values as strings. A body not
    received in full within `timeout_s` seconds (--body-timeout) is a 408: a client that sends a
    few bytes and stalls holds no connection and no handler for long."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _too_large()  # refuse before reading a byte of it
    ctype = request.content_type
    try:
        if ctype in JSON_TYPES or ctype.endswith("+json"):
            return _json_object(await asyncio.wait_for(request.read(), timeout_s))
        if ctype in FORM_TYPES:
            return await asyncio.wait_for(_form(request), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large() from None
    except asyncio.TimeoutError:
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout); send it at once"
        ) from None
    raise BodyError(
        415,
        f"unsupported Content-Type {ctype!r}; send application/json, "
        "application/x-www-form-urlencoded or multipart/form-data",
    )


def _too_large() -> BodyError:
    return BodyError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise BodyError(400, 'request body is empty; send a JSON object such as {"text": "Hello"}')
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise BodyError(
            400, f'request body must be a JSON object such as {{"text": "Hello"}}, got a {_json_kind(value)}'
        )
    check_unicode(value)
    return value


def check_unicode(value: dict[str, Any], what: str = "request body") -> None:
    """A 400 for a string holding a lone UTF-16 surrogate (JSON's "\ud800" escapes decode to one):
    it is no Unicode text, has no UTF-8 form, and replacing it would speak something the client
    did not send, so the client is told to fix its encoder."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        strings = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        for x in strings:
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise BodyError(
                        400,
                        f"{what} holds a lone UTF-16 surrogate ({ascii(x[e.start])}) at character "
                        f"{e.start} of a string; send valid Unicode (a pair \\ud83d\\ude00 is fine)",
                    ) from None
            elif isinstance(x, dict | list):
                stack.append(x)


async def _form(request: web.Request) -> dict[str, Any]:
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise
    except UnicodeDecodeError as e:
        raise BodyError(400, f"form body is not valid UTF-8 (byte {e.start})") from None
    except Exception as e:  # aiohttp raises assorted errors on malformed multipart
        raise BodyError(400, f"could not parse the form body: {e}") from None
    fields: dict[str, Any] = {}
    for key, value in form.items():
        if key in fields:
            raise BodyError(400, f"form field {key!r} is given more than once")
        if not isinstance(value, str):
            raise BodyError(400, f"form field {key!r} must be a plain value, not a file upload")
        fields[key] = value
    return FormFields(fields)


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)
