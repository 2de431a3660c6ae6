"""A gateway restarted by the supervisor knows nothing of what the gpu_workers still generate for
its predecessor's clients: it greets each gpu_worker with `Abort(everything=True)` before sending it
anything, and the engine drops every request it holds, pages and slots back."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from common.config import GpuWorkerSettings
from common.messages import Abort, FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from tests.conftest import gpu_dispatch


def test_a_dispatcher_greets_each_worker_once_before_anything_else():
    with gpu_dispatch("w", greeting=Abort(rids=[], everything=True)) as (loop, pool, workers):
        worker = workers["w"]
        got: list = []

        async def run() -> None:
            pool.start()
            send = asyncio.create_task(pool.send(Prompt("p", b"\x00\x00\x00\x00", 1, SamplingParams())))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                worker.offer(2)  # announces again and again: greeted once only
                got.extend(worker.drain())
                await asyncio.sleep(0.01)
            await send

        loop.run_until_complete(run())
        assert isinstance(got[0], Abort) and got[0].everything
        assert [type(m).__name__ for m in got] == ["Abort", "Prompt"]


def test_abort_everything_ends_every_request_and_frees_the_cache():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    eng = Engine(p, GpuWorkerSettings(max_batch_size=2, max_context=200))
    rows = np.array([128259, 300, 128009, 128260, 128261, 128257], dtype="<i4")
    for i in range(3):  # two running, one waiting
        eng.add(Prompt(f"r{i}", rows.tobytes(), len(rows), SamplingParams(max_tokens=150, constrained=True)))
    for _ in range(3):
        eng.step()
    eng.abort_all()
    ends = {f.rid: f.reason for batch in eng.run_until_idle() for f in batch.finished}
    assert ends == {"r0": FinishReason.ABORT, "r1": FinishReason.ABORT, "r2": FinishReason.ABORT}
    assert eng.allocator.num_used == 0 and eng.slots.num_free == 2 and not eng.has_work()
