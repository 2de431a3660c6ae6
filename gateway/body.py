"""Reading a request body into a field dict: JSON objects and HTML forms (urlencoded or multipart).

Kept apart from validation so that `validation.parse_generate` stays a pure function of the fields;
this module owns everything about bytes on the wire: content types, size limits, UTF-8, JSON syntax.

An endpoint that takes a reference clip (voice cloning) reads with `clip_bytes` > 0: a multipart
form may carry one file, the field `audio`, up to `clip_bytes` (an `Upload`), and with `inline`
its fields may carry the clip as base64 (a JSON `ref_audio`): the body may be larger by that
much. Every other body stays under MAX_BODY_BYTES and refuses files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
from aiohttp import web

from gateway.fields import FormFields
from gateway.timeouts import within

MAX_BODY_BYTES = 1 << 20  # the Application's client_max_size; a text request needs far less

CLIP_FIELD = "audio"  # the multipart file field of a reference clip
JSON_TYPES = ("application/json",)
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


class BodyError(Exception):
    """A body the gateway cannot read; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass(frozen=True)
class Upload:
    """A file of a multipart form (the reference clip's `audio` field)."""

    data: bytes
    filename: str = ""
    content_type: str = ""


def body_limit(clip_bytes: int) -> int:
    """The largest body an endpoint reads: MAX_BODY_BYTES, plus a clip's file or its base64."""
    return MAX_BODY_BYTES + (4 * (clip_bytes + 2) // 3 + (64 << 10) if clip_bytes else 0)


async def read_fields(
    request: web.Request, timeout_s: float, clip_bytes: int = 0, inline: bool = False
) -> dict[str, Any]:
    """The body's fields: a JSON object as decoded, or a form's values as strings (and an `Upload`
    under `audio` when `clip_bytes` > 0; `inline`: a field may hold the clip as base64). A body
    not received in full within `timeout_s` seconds (--body-timeout) is a 408: a client that sends
    a few bytes and stalls holds no connection and no handler for long."""
    ctype = request.content_type
    file = clip_bytes > 0 and ctype == "multipart/form-data"
    limit = body_limit(clip_bytes) if inline else MAX_BODY_BYTES  # the fields' bytes
    total = body_limit(clip_bytes) if file or inline else MAX_BODY_BYTES
    if request.content_length is not None and request.content_length > total:
        raise _too_large(total)  # refuse before reading a byte of it
    try:
        if ctype in JSON_TYPES or ctype.endswith("+json"):
            raw = await within(request.read(), timeout_s)
            if len(raw) > limit:  # a chunked body: the app's cap is the largest endpoint's
                raise _too_large(limit)
            return _json_object(raw)
        if ctype == "multipart/form-data":
            return await within(_multipart(request, clip_bytes, limit), timeout_s)
        if ctype in FORM_TYPES:
            raw = await within(request.read(), timeout_s)  # _form parses it from here
            if len(raw) > limit:
                raise _too_large(limit)
            return await _form(request)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except asyncio.TimeoutError:
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout); send it at once"
        ) from None
    raise BodyError(
        415,
        f"unsupported Content-Type {ctype!r}; send application/json, "
        "application/x-www-form-urlencoded or multipart/form-data",
    )


def _too_large(limit: int = MAX_BODY_BYTES) -> BodyError:
    return BodyError(413, f"request body is larger than {limit} bytes")


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
    """An urlencoded form (its body read already)."""
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


async def _multipart(request: web.Request, clip_bytes: int, limit: int) -> dict[str, Any]:
    """A multipart form: plain fields as strings (`limit` bytes of them in all) and, where the
    endpoint takes a clip (`clip_bytes` > 0), the file field `audio` as an Upload of at most
    `clip_bytes`; any other file is refused."""
    try:
        reader = await request.multipart()
    except Exception as e:
        raise BodyError(400, f"could not parse the form body: {e}") from None
    fields: dict[str, Any] = {}
    plain = 0  # bytes of plain fields so far
    while True:
        try:
            part = await reader.next()
        except Exception as e:  # aiohttp raises assorted errors on malformed multipart
            raise BodyError(400, f"could not parse the form body: {e}") from None
        if part is None:
            break
        if not isinstance(part, aiohttp.BodyPartReader) or not part.name:
            raise BodyError(400, "the form holds a part without a field name (or a nested multipart)")
        key = part.name
        if key in fields:
            raise BodyError(400, f"form field {key!r} is given more than once")
        clip = clip_bytes > 0 and key == CLIP_FIELD
        if part.filename is not None and not clip:
            raise BodyError(400, f"form field {key!r} must be a plain value, not a file upload")
        cap = clip_bytes if clip else limit - plain
        data = await _read_part(part, cap)
        if data is None:
            if clip:  # a clip over its limit is the clip's fault, as one in a field is (gateway.clips)
                raise BodyError(
                    400,
                    f"field {key!r}: the reference clip is larger than {clip_bytes} bytes "
                    "(--max-reference-bytes); send a shorter clip",
                )
            raise _too_large(limit)
        if clip:
            fields[key] = Upload(data, part.filename or "", part.headers.get("Content-Type", ""))
            continue
        plain += len(data)
        try:
            fields[key] = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BodyError(400, f"form body is not valid UTF-8 (byte {e.start})") from None
    return FormFields(fields)


async def _read_part(part: aiohttp.BodyPartReader, cap: int) -> bytes | None:
    """A part's decoded bytes, or None when it holds more than `cap`."""
    out = bytearray()
    while True:
        try:
            chunk = await part.read_chunk(1 << 16)
        except Exception as e:
            raise BodyError(400, f"could not parse the form body: {e}") from None
        if not chunk:
            return bytes(part.decode(bytes(out))) if out else b""
        out += chunk
        if len(out) > cap:
            return None


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)
