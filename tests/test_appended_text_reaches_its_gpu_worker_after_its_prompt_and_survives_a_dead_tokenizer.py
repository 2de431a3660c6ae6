"""The gateway's router of appended text (`gateway.appending.TextRouter`) over real ZMQ sockets and
the pool's dispatchers: pieces of one tick go to a tokenizer worker as one `AppendText`; the pieces
a tokenizer worker held when it died are tokenized again and a second answer is dropped; appends
wait until their request's prompt is on a gpu_worker, then go to that worker alone, one `Appends`
per tick, outside its credit."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import numpy as np

from common.arrays import wire_array
from common.ipc import Addresses
from common.messages import Append, AppendedText, Appends, AppendText, TextPiece, TextRows, TokenizerInMsg
from common.pool import AsyncDispatchChannel, AsyncWorkChannel
from gateway.appending import TextRouter
from tests.conftest import gpu_dispatch


def test_pieces_are_tokenized_again_when_their_worker_dies():
    d = tempfile.mkdtemp(prefix="vpappend-")
    loop = asyncio.new_event_loop()
    addrs = Addresses.local(d)

    async def scenario() -> None:
        pool: AsyncDispatchChannel[TokenizerInMsg] = AsyncDispatchChannel(addrs.requests)
        worker = AsyncWorkChannel(addrs.requests, TokenizerInMsg, name="tokenizer_worker.1")
        router = TextRouter(lambda: pool, lambda: None, 5.0)
        got: list[TextRows] = []
        try:
            pool.start()
            router.listen("s/0", got.append)
            router.listen("t/0", got.append)
            router.tokenize(TextPiece("s/0", 0, "Hello wor", False))
            router.tokenize(TextPiece("t/0", 3, "Yes.", True))
            first = await asyncio.wait_for(worker.recv(), 5)
            assert isinstance(first, AppendText) and [p.rid for p in first.pieces] == ["s/0", "t/0"]
            router.took(AppendedText([TextRows("t/0", 3, taken="Yes.")]))
            router.worker_died("tokenizer_worker.1")  # with s/0's piece in hand
            again = await asyncio.wait_for(worker.recv(), 5)
            assert isinstance(again, AppendText) and again.pieces == [first.pieces[0]]
            answer = AppendedText([TextRows("s/0", 0, taken="Hello", held=" wor")])
            router.took(answer)
            router.took(answer)  # the dead worker's, on its way before it died
            assert [(r.rid, r.seq) for r in got] == [("t/0", 3), ("s/0", 0)]
        finally:
            worker.close()
            await pool.aclose()

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
        shutil.rmtree(d, ignore_errors=True)


def test_appends_follow_the_prompt_to_its_gpu_worker_alone():
    with gpu_dispatch("gpu_worker.0", "gpu_worker.1") as (loop, pool, workers):

        async def scenario() -> None:
            router = TextRouter(lambda: None, lambda: pool, 5.0)
            for chan in workers.values():
                chan.offer(1)
            pool.start()
            while len(pool.workers) < 2:
                await asyncio.sleep(0.01)
            ident = next(i for i, n in pool.workers.items() if n == "gpu_worker.1")
            router.listen("s/0", lambda rows: None)
            rows = wire_array(np.arange(3, dtype=np.int32))
            router.append(Append("s/0", {"text": rows}, 3))  # its prompt is not on a worker yet
            await asyncio.sleep(0.05)
            assert not any(chan.drain(timeout_ms=20) for chan in workers.values())
            router.routed("s/0", ident)
            router.append(Append("s/0", {}, 0, end=True))
            await asyncio.sleep(0.05)
            assert workers["gpu_worker.0"].drain(timeout_ms=20) == []
            got = workers["gpu_worker.1"].drain(timeout_ms=200)
            assert len(got) == 1 and isinstance(got[0], Appends)  # both in one message
            assert [(a.rid, a.n_rows, a.end) for a in got[0].items] == [("s/0", 3, False), ("s/0", 0, True)]
            router.forget("s/0")
            router.append(Append("s/0", {}, 0))  # a forgotten request's: dropped
            await asyncio.sleep(0.05)
            assert workers["gpu_worker.1"].drain(timeout_ms=20) == []

        loop.run_until_complete(scenario())
