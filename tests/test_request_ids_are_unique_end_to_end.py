"""Request ids are unique end to end: a long text's segments never take a client's id, and an id
stays claimed from the request's arrival, also while its body is still on the way."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio

import numpy as np

from common.messages import FinishReason
from tests.test_gateway import Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

PART_SEP = "/"  # the gateway's ids for a request's parts: <request id>/<k>, never a client's id

THREE_SENTENCES = "The first sentence is here. The second one follows it. And a third ends it."


def _pcm(value: int, n: int) -> bytes:
    return np.full(n, value, dtype="<i2").tobytes()


async def test_a_long_texts_segments_never_take_a_clients_request_id(rig: Rig) -> None:
    short = rig.post(json={"text": "Hello there"}, headers={"X-Request-Id": "Q.1"})
    mine = await rig.workers.next_request()
    assert mine.rid == "Q.1"
    long = rig.post(json={"text": THREE_SENTENCES, "streaming": False}, headers={"X-Request-Id": "Q"})
    rids = []
    for _ in range(3):
        req = await rig.workers.next_request()
        rids.append(req.rid)
        await rig.workers.audio(req.rid, _pcm(7, 1000), finish=FinishReason.STOP)
    assert rids == [f"Q{PART_SEP}{k}" for k in range(3)] and "Q.1" not in rids
    await rig.workers.audio("Q.1", _pcm(5, 600), finish=FinishReason.STOP)
    resp_short, resp_long = await short, await long
    body_short, body_long = await resp_short.read(), await resp_long.read()
    assert resp_short.status == 200 and resp_long.status == 200
    # Each client hears its own audio only: none of the other's samples went to the wrong stream.
    assert np.frombuffer(body_short[44:], dtype="<i2").tolist() == [5] * 600
    assert len(body_long) == 44 + 2 * 3000


async def test_a_second_request_with_the_id_of_one_still_sending_its_body_gets_409(rig: Rig) -> None:
    body = b'{"text": "Hello there"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.client.port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: D\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5]
    )
    await writer.drain()
    await asyncio.sleep(0.3)  # the first request is in its handler, reading its body
    second = await rig.client.post("/generate", json={"text": "Hi"}, headers={"X-Request-Id": "D"})
    assert second.status == 409 and "already in flight" in (await second.json())["error"]
    writer.write(body[5:])
    await writer.drain()
    req = await rig.workers.next_request()
    assert req.rid == "D" and req.text == "Hello there"
    await rig.workers.audio("D", _pcm(3, 100), finish=FinishReason.STOP)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()
    # Once the first has ended, its id is free again.
    third = rig.post(json={"text": "Again"}, headers={"X-Request-Id": "D"})
    req = await rig.workers.next_request()
    await rig.workers.audio("D", _pcm(3, 100), finish=FinishReason.STOP)
    assert req.rid == "D" and (await third).status == 200


async def test_a_client_id_holding_the_part_separator_is_replaced_by_the_gateways_own(rig: Rig) -> None:
    task = rig.post(json={"text": "Hello"}, headers={"X-Request-Id": f"Q{PART_SEP}1"})
    req = await rig.workers.next_request()
    assert PART_SEP not in req.rid
    await rig.workers.audio(req.rid, _pcm(1, 10), finish=FinishReason.STOP)
    resp = await task
    assert resp.status == 200 and resp.headers["X-Request-Id"] == req.rid
