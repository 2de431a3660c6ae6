"""Native input streaming's pieces of text (`gateway.appending.TextRouter`) over the real pool
sockets: while an `AppendText` waits for a free tokenizer worker, the pieces of the ticks after it
collect and follow as one message, so the pool's queue holds at most one of them, ahead of the
prompts, however many sessions append and however long the workers stay busy."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from common.ipc import Addresses
from common.messages import AppendText, TextPiece, TokenizerInMsg
from common.pool import AsyncDispatchChannel, AsyncWorkChannel
from gateway.appending import TextRouter


def test_pieces_of_many_ticks_wait_for_a_busy_pool_as_one_message():
    d = tempfile.mkdtemp(prefix="vpqueue-")
    loop = asyncio.new_event_loop()
    addrs = Addresses.local(d)

    async def scenario() -> None:
        pool: AsyncDispatchChannel[TokenizerInMsg] = AsyncDispatchChannel(addrs.requests)
        worker = AsyncWorkChannel(addrs.requests, TokenizerInMsg, name="tokenizer_worker.0")
        router = TextRouter(lambda: pool, lambda: None, 5.0)
        try:
            pool.start()
            for k in range(6):
                router.listen(f"s{k}/0", lambda rows: None)
            router.tokenize(TextPiece("s0/0", 0, "Hello", False))
            await asyncio.sleep(0.02)  # its own tick: an AppendText, no worker free to take it
            assert pool.num_waiting == 1
            for k in range(1, 6):  # five more ticks, one session each
                router.tokenize(TextPiece(f"s{k}/0", 0, f"Word {k}", False))
                await asyncio.sleep(0.02)
            assert pool.num_waiting == 1, "the later pieces wait here, not as messages in the pool"
            first = await asyncio.wait_for(worker.recv(), 5)  # the worker frees up
            assert isinstance(first, AppendText) and [p.rid for p in first.pieces] == ["s0/0"]
            second = await asyncio.wait_for(worker.recv(), 5)
            assert isinstance(second, AppendText)
            assert [p.text for p in second.pieces] == [f"Word {k}" for k in range(1, 6)]
            try:
                third = await asyncio.wait_for(worker.recv(), 0.3)
            except asyncio.TimeoutError:
                third = None
            assert third is None and pool.num_waiting == 0
        finally:
            worker.close()
            await pool.aclose()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
        shutil.rmtree(d, ignore_errors=True)
