"""A long text's later segments are `urgent`: their stream is already playing. They go ahead of new
requests in the gateway's dispatch to workers and in the gpu_worker's admission, so a busy server
makes newcomers wait, not the listener in the middle of a text."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from test_several_gpu_workers import _prompt

from common.config import GpuWorkerSettings
from common.messages import GenerateRequest, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from tests.conftest import gpu_dispatch
from tokenizer_worker.worker import PromptBuilder


def test_the_dispatcher_hands_out_urgent_messages_first_in_their_own_order():
    with gpu_dispatch("w") as (loop, pool, workers):
        worker = workers["w"]
        got: list = []

        async def spin(seconds: float, offer: int = 0) -> None:
            pool.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if offer:
                    worker.offer(offer)
                got.extend(worker.drain())
                await asyncio.sleep(0.01)

        async def scenario() -> None:
            await spin(0.2)  # the worker is connected but offers nothing: everything waits
            sends = [
                asyncio.ensure_future(pool.send(_prompt(r), urgent=r.startswith("u")))
                for r in ("a", "b", "u1")
            ]
            await asyncio.sleep(0.05)
            cancelled = asyncio.ensure_future(pool.send(_prompt("u-gone"), urgent=True))
            sends += [
                asyncio.ensure_future(pool.send(_prompt(r), urgent=r.startswith("u"))) for r in ("u2", "c")
            ]
            await asyncio.sleep(0.05)
            cancelled.cancel()  # a client gone: its place in the urgent queue is freed
            await spin(0.5, offer=5)
            await asyncio.gather(*sends)

        loop.run_until_complete(scenario())
        assert [m.rid for m in got if isinstance(m, Prompt)] == ["u1", "u2", "a", "b", "c"]
        assert pool.num_waiting == 0 and pool._n_urgent == 0


def test_the_engine_admits_urgent_prompts_before_new_ones():
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_lm()
    eng = Engine(program, GpuWorkerSettings(max_batch_size=1, max_context=100))
    rows = np.array([128259, 300, 301, 128009, 128260, 128261, 128257], dtype="<i4")

    def prompt(rid: str, urgent: bool = False) -> Prompt:
        sp = SamplingParams(max_tokens=30, min_tokens=20, constrained=True, seed=1)
        return Prompt(rid, rows.tobytes(), len(rows), sp, urgent=urgent)

    eng.add(prompt("running"))
    eng.step()  # the one slot is taken: everything below waits
    for p in (prompt("new1"), prompt("seg1", True), prompt("new2"), prompt("seg2", True)):
        eng.add(p)
    order = ["running"]
    while eng.has_work():
        eng.step()
        order += [rid for rid in eng.running if rid not in order]
    assert order == ["running", "seg1", "seg2", "new1", "new2"]


def test_the_prompt_builder_keeps_the_flag():
    # (The gateway sets it on segments after the first: tests/test_long_text_segments.py.)
    spec = get_spec("orpheus-tiny")
    builder = PromptBuilder(load_program_class("orpheus-tiny")(spec), 400)
    req = GenerateRequest("r.1", "hello", SamplingParams(), urgent=True)
    assert builder.build(req).urgent
    assert not builder.build(GenerateRequest("r", "hello", SamplingParams())).urgent
