"""The gateway's inbox (`AsyncPullChannel.recv_batch`): one wait returns the message that ended it
and every message queued behind it, in the order sent (at most `limit` at a time, the rest at the
next call), skipping malformed ones; with nothing queued the call waits for the next message."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq

from common.ipc import AsyncPullChannel, PushChannel
from common.messages import AudioChunk, AudioChunks, GatewayInMsg


def chunks(i: int) -> AudioChunks:
    return AudioChunks(chunks=[AudioChunk(rid=f"r{i}", index=i, pcm=b"\x01\x00" * (i + 1))])


def test_one_wait_takes_what_is_queued_in_order_and_skips_the_malformed(tmp_path: Path):
    addr = f"ipc://{tmp_path / 'gateway_in'}"

    async def main() -> None:
        inbox: AsyncPullChannel[GatewayInMsg] = AsyncPullChannel(addr, GatewayInMsg, bind=True)
        push = PushChannel(addr)
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(addr)
        try:
            for i in range(5):
                push.send(chunks(i))
            raw.send(b"\xc1 not msgpack")
            for i in range(5, 8):
                push.send(chunks(i))
            await asyncio.sleep(0.2)  # all eight queued at the socket
            got = await asyncio.wait_for(inbox.recv_batch(limit=6), 5)
            assert [m.chunks[0].index for m in got] == [0, 1, 2, 3, 4]  # six frames, one malformed
            got = await asyncio.wait_for(inbox.recv_batch(limit=6), 5)
            assert [m.chunks[0].index for m in got] == [5, 6, 7]

            # Nothing queued: the call waits, and a message sent meanwhile ends the wait
            waiting = asyncio.create_task(inbox.recv_batch())
            await asyncio.sleep(0.1)
            assert not waiting.done()
            t0 = time.monotonic()
            push.send(chunks(8))
            got = await asyncio.wait_for(waiting, 5)
            assert [m.chunks[0].index for m in got] == [8] and time.monotonic() - t0 < 1.0
            # only malformed ones queued: the call goes on waiting past them
            raw.send(b"\xc1")
            waiting = asyncio.create_task(inbox.recv_batch())
            await asyncio.sleep(0.1)
            assert not waiting.done()
            push.send(chunks(9))
            got = await asyncio.wait_for(waiting, 5)
            assert [m.chunks[0].index for m in got] == [9]
        finally:
            raw.close(linger=0)
            push.close()
            inbox.close()

    asyncio.run(main())
