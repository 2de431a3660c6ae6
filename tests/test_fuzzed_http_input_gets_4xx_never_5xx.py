"""Hostile HTTP input, fuzzed with hypothesis against every endpoint the running gateway lists in
its /openapi.json (and paths it does not): bodies built from the published schemas with hostile
values (NaN, Infinity, 1e308, 400-digit integers, negative or absurd max_tokens, junk of every type),
invalid UTF-8, truncated JSON, nesting bombs, thousands of fields, bodies over the size limit,
wrong content types, multipart file uploads, junk headers and query strings. Every answer is below
500, every error is JSON that says why, and afterwards every process is still up and serving.

A valid request starts a generation: its answer is taken as the response headers (streamed audio
starts at once); one that has not answered within READ_TIMEOUT_S is dropped by the client, which
the gateway turns into an abort."""

from __future__ import annotations

import http.client
import json
import os
import string
import time
import urllib.parse
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Server, get_json

EXAMPLES = int(os.environ.get("VOXPIPE_FUZZ_EXAMPLES", "300"))
READ_TIMEOUT_S = 0.5
BODY_LIMIT = 1 << 20
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")


@pytest.fixture(scope="module")
def server():
    srv = Server("--tokenizer-workers", "1")
    yield srv
    srv.stop()


# -- values ----------------------------------------------------------------------------------------

huge_ints = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=10**400),
    st.integers(min_value=-(10**400), max_value=-1),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**100]),
)
hostile_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0]),
)
junk_text = st.one_of(
    st.text(max_size=50),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=20),
    st.sampled_from(["", " ", "\x00", "\ud800", "NaN", "1e999", "-1", "true", "null", "{}", "💥" * 3]),
)
leaf = st.one_of(st.none(), st.booleans(), huge_ints, hostile_floats, junk_text)
junk = st.recursive(
    leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(junk_text, kids, max_size=4), max_leaves=8
)


def value_for(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value the schema allows, or (more often) one it does not."""
    kind = schema.get("type")
    if "enum" in schema:
        valid: st.SearchStrategy[Any] = st.sampled_from(schema["enum"])
    elif kind == "string":
        valid = st.text(min_size=1, max_size=40)
    elif kind == "integer":
        lo, hi = schema.get("minimum", -(2**31)), schema.get("maximum", 2**31)
        valid = st.integers(min_value=int(lo), max_value=int(hi))
    elif kind == "number":
        lo, hi = schema.get("minimum", -1e6), schema.get("maximum", 1e6)
        valid = st.floats(min_value=float(lo), max_value=float(hi))
    elif kind == "boolean":
        valid = st.booleans()
    else:
        valid = junk
    return st.one_of(valid, junk, huge_ints, hostile_floats)


def schema_object(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties", {})
    return st.fixed_dictionaries(
        {}, optional={name: value_for(sub) for name, sub in props.items()}
    ) | st.dictionaries(junk_text, junk, max_size=5)


# -- requests --------------------------------------------------------------------------------------


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True, default=str).encode("utf-8", "surrogatepass")


def _form_bytes(obj: dict[str, Any]) -> bytes:
    pairs = [(str(k), v if isinstance(v, str) else json.dumps(v, allow_nan=True)) for k, v in obj.items()]
    return urllib.parse.urlencode(
        [(k.encode("utf-8", "surrogatepass"), v.encode("utf-8", "surrogatepass")) for k, v in pairs]
    ).encode()


def _multipart(obj: dict[str, Any], file_field: bool) -> tuple[bytes, str]:
    boundary = "vpfuzzboundary"
    parts = []
    for k, v in obj.items():
        value = v if isinstance(v, str) else json.dumps(v, allow_nan=True)
        name = str(k).replace('"', "").encode("utf-8", "surrogatepass")
        head = b'Content-Disposition: form-data; name="' + name + b'"'
        if file_field:
            head += b'; filename="a.wav"\r\nContent-Type: audio/wav'
        parts.append(
            b"--" + boundary.encode() + b"\r\n" + head + b"\r\n\r\n" + value.encode("utf-8", "surrogatepass")
        )
    body = b"\r\n".join(parts) + b"\r\n--" + boundary.encode() + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


@st.composite
def body_for(draw: st.DrawFn, schema: dict[str, Any]) -> tuple[bytes, str]:
    """(body, content type): schema-shaped with hostile values, or hostile bytes."""
    obj = draw(schema_object(schema))
    kind = draw(
        st.sampled_from(
            [
                "json",
                "json",
                "json",
                "form",
                "multipart",
                "file",
                "truncated",
                "utf8",
                "deep",
                "wide",
                "huge",
                "bytes",
            ]
        )
    )
    ctype = "application/json"
    if kind == "json":
        body = _json_bytes(obj)
    elif kind == "form":
        body, ctype = _form_bytes(obj), "application/x-www-form-urlencoded"
    elif kind in ("multipart", "file"):
        body, ctype = _multipart(obj, kind == "file")
    elif kind == "truncated":
        full = _json_bytes(obj)
        body = full[: draw(st.integers(0, max(0, len(full) - 1)))]
    elif kind == "utf8":  # invalid UTF-8 inside an otherwise valid JSON object
        body = _json_bytes({**obj, "text": "X"}).replace(b'"X"', b'"\xff\xfe\xc3\x28 \xed\xa0\x80"')
    elif kind == "deep":
        n = draw(st.sampled_from([1000, 100_000]))
        inner = "[" * n + "]" * n if draw(st.booleans()) else '{"a":' * n + "1" + "}" * n
        body = ('{"text": ' + inner + "}").encode()
    elif kind == "wide":
        n = draw(st.sampled_from([1000, 5000]))
        fields = {f"f{i}": i for i in range(n)}
        if draw(st.booleans()):
            body, ctype = _form_bytes(fields), "application/x-www-form-urlencoded"
        else:
            body = _json_bytes({**obj, **fields})
    elif kind == "huge":  # over the body limit: refused before it is read
        body = b'{"text": "' + b"a" * (BODY_LIMIT + draw(st.integers(1, 4096))) + b'"}'
    else:
        body = draw(st.binary(max_size=200))
    if draw(st.integers(0, 9)) == 0:  # now and then the wrong (or a junk) content type
        ctype = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/xml",
                    "",
                    "application/json; charset=latin-1",
                    "multipart/form-data",
                    "x/y; boundary=",
                ]
            )
        )
    return body, ctype


_SAFE = string.ascii_letters + string.digits + "-._~"


@st.composite
def request(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    paths = list(doc["paths"])
    speech = [p for p in paths if "post" in doc["paths"][p]]  # the bodies: most of the attack surface
    path = draw(st.sampled_from(speech) | st.sampled_from([*paths, "unknown"]))
    if path == "unknown":
        url = "/" + "/".join(draw(st.lists(st.text(alphabet=_SAFE, min_size=1, max_size=8), max_size=3)))
        ops: dict[str, Any] = {}
    else:
        ops = doc["paths"][path]
        url = path.replace(
            "{model}", draw(st.one_of(st.just("orpheus-tiny"), st.text(alphabet=_SAFE, min_size=1)))
        )
    documented = [m.upper() for m in ops] or ["GET"]
    method = draw(st.sampled_from(documented) if draw(st.integers(0, 4)) else st.sampled_from(METHODS))
    if draw(st.booleans()):
        url += "?" + urllib.parse.urlencode(
            draw(st.dictionaries(junk_text, junk_text, max_size=3)), encoding="utf-8", errors="surrogatepass"
        )
    op = ops.get(method.lower(), {})
    content = op.get("requestBody", {}).get("content", {})
    schema: dict[str, Any] = {}
    if content:
        ref = next(iter(content.values()))["schema"].get("$ref", "")
        schema = doc["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
    body, ctype = (
        draw(body_for(schema)) if method not in ("GET", "HEAD") or draw(st.booleans()) else (b"", "")
    )
    headers = {"Content-Type": ctype} if ctype else {}
    if draw(st.booleans()):
        headers["X-Request-Id"] = draw(
            st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=80)
        )
    return {"method": method, "url": url, "body": body, "headers": headers}


def send(port: int, req: dict[str, Any]) -> tuple[int, bytes, dict[str, str]] | None:
    """(status, body, headers), or None when a generation was started and dropped unanswered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READ_TIMEOUT_S)
    try:
        conn.request(req["method"], req["url"], body=req["body"] or None, headers=req["headers"])
        resp = conn.getresponse()
        if resp.status == 200 and resp.getheader("Content-Type", "").startswith(
            ("audio/", "text/event-stream")
        ):
            return resp.status, b"", dict(resp.getheaders())  # audio is flowing: enough
        return resp.status, resp.read(), dict(resp.getheaders())
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        # A body over the limit is refused before it is all sent; the answer may still be there.
        try:
            resp = conn.getresponse()
            return resp.status, resp.read(), dict(resp.getheaders())
        except Exception:
            return 413, b'{"error": "connection closed while sending an oversized body"}', {}
    finally:
        conn.close()


class Count:
    fuzzed = 0
    dropped = 0
    by_status: dict[int, int] = {}


def test_fuzzed_requests_to_every_endpoint_get_json_4xx_and_no_process_goes_down(server: Server) -> None:
    code, doc = get_json(server.base + "/openapi.json")
    assert code == 200 and doc["paths"]
    _, ready = get_json(server.base + "/ready")
    pids = {p["name"]: p["pid"] for p in ready["processes"]}
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(req=request(doc))
    def fuzz(req: dict[str, Any]) -> None:
        Count.fuzzed += 1
        got = send(server.port, req)
        if got is None:
            Count.dropped += 1
            return
        status, body, _ = got
        Count.by_status[status] = Count.by_status.get(status, 0) + 1
        case = f"{req['method']} {req['url'][:80]} {req['headers']} {req['body'][:120]!r} → {status} {body[:200]!r}"
        assert status < 500, case
        if status >= 400 and req["method"] != "HEAD":
            err = json.loads(body)["error"]
            message = err["message"] if isinstance(err, dict) else err
            assert isinstance(message, str) and message, case

    fuzz()
    took = time.monotonic() - started
    print(
        f"\nfuzzed {Count.fuzzed} HTTP inputs in {took:.0f} s: statuses {dict(sorted(Count.by_status.items()))}, "
        f"{Count.dropped} valid generations dropped by the client after {READ_TIMEOUT_S} s"
    )
    raw = raw_garbage(server.port)
    print(f"and {len(raw)} inputs that are not HTTP at all: answers {raw}")
    # Every process survived: same pids, all ready, and a normal request still succeeds.
    deadline = time.monotonic() + 10
    while (ready := get_json(server.base + "/ready"))[0] != 200:
        assert time.monotonic() < deadline, ready
        time.sleep(0.1)
    assert {p["name"]: p["pid"] for p in ready[1]["processes"]} == pids
    status, audio, _ = send_whole(server.port, {"text": "Still here.", "max_tokens": 60, "streaming": False})
    assert status == 200 and audio[:4] == b"RIFF"


def send_whole(port: int, body: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


RAW = [
    b"\x00\xff" * 64 + b"\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(2000)) + b"\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
]


def raw_garbage(port: int) -> list[str]:
    """Bytes that are not (valid) HTTP, on raw sockets: the status line of each answer (the HTTP
    parser answers these itself, in plain text; none may be a 5xx)."""
    import socket

    answers = []
    for data in RAW:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            try:
                sock.sendall(data)
                first = sock.recv(200).split(b"\r\n", 1)[0].decode("latin-1")
            except (ConnectionResetError, BrokenPipeError, TimeoutError):
                first = "closed"
        assert not first.split(" ")[1:2] or not first.split(" ")[1].startswith("5"), (data[:80], first)
        answers.append(first or "closed")
    return answers
