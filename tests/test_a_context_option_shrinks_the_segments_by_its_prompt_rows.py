"""A model option that adds prompt rows (CSM's conversation context) is counted by the program, on
the tokenizer side, and the gateway cuts a long text for the budget those rows leave: every
segment's prompt and audio still fit max_tokens."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from common.config import ServeConfig, TokenizerSettings
from common.ipc import Addresses
from common.messages import FinishReason, GenerateRequest, PromptSize, RequestError, SamplingParams
from gateway.segments import segment_budget
from gateway.server import build_app
from programs import get_spec, load_program_class
from tests.specs import model_spec
from tests.test_gateway import FakeWorkers, make_addrs  # noqa: F401 (fixture)
from tokenizer_worker.worker import PromptBuilder

FRAMES = [[(f + k) % 2048 for k in range(32)] for f in range(40)]
CONTEXT = json.dumps([{"speaker": 0, "text": "An earlier turn.", "codes": FRAMES}] * 5)
TEXT = " ".join(f"Sentence number {i} is spoken here." for i in range(5))  # 169 bytes


def test_the_program_counts_exactly_the_rows_a_context_adds() -> None:
    program = load_program_class("csm-tiny")(get_spec("csm-tiny"), load_format="dummy")
    builder = PromptBuilder(program, max_context=10_000)
    req = GenerateRequest("r", "", SamplingParams(), {"voice": "1", "context": CONTEXT}, size_only=True)
    size = builder.build(req)
    with_context = program.preprocess("Hello.", {"voice": "1", "context": CONTEXT})
    alone = program.preprocess("Hello.", {"voice": "1"})
    assert size == PromptSize("r", len(with_context) - len(alone))
    bad = builder.build(GenerateRequest("b", "", SamplingParams(), {"context": "[{}]"}, size_only=True))
    assert isinstance(bad, RequestError) and bad.status == 400


async def test_the_gateway_cuts_the_text_for_what_the_context_leaves(
    make_addrs: Callable[[], Addresses],
) -> None:
    addrs = make_addrs()
    cfg = ServeConfig(model="csm-tiny", tokenizer=TokenizerSettings(workers=1), addresses=addrs)
    spec = model_spec("csm-tiny")
    workers = FakeWorkers(addrs)
    client = TestClient(TestServer(build_app(cfg)))
    await client.start_server()
    try:
        await workers.join_gpu_pool(client.app)
        await workers.announce(client.app, cfg.model)
        assert segment_budget(spec, spec.max_tokens) >= len(TEXT.encode())  # alone: one generation
        task = asyncio.create_task(
            client.post("/generate", json={"text": TEXT, "context": CONTEXT, "streaming": False})
        )
        sizing = await workers.next_request()
        assert sizing.size_only and sizing.model_kwargs["context"] == CONTEXT
        rows = 300
        await workers.send(PromptSize(sizing.rid, rows))
        budget = segment_budget(spec, spec.max_tokens - rows)
        texts = []
        while True:
            req = await workers.next_request()
            assert not req.size_only and len(req.text.encode()) <= budget
            texts.append(req.text)
            await workers.audio(req.rid, b"\0\0" * 100, finish=FinishReason.STOP)
            if " ".join(texts) == TEXT:
                break
        assert len(texts) > 1 and (await task).status == 200
    finally:
        await client.close()
        workers.close()
