"""KV pages run out: requests wait (in the engine, and in the gateway while the gpu_worker offers
no credit) and all complete; nothing crashes and every page comes back."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.kv_cache import pages_for
from programs import get_spec, load_program_class
from tests.conftest import Server, get_json


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    return p


def prompt(rid: str, max_tokens: int) -> Prompt:
    rows = np.array([128259, 128000, 40, 41, 128009, 128260, 128261, 128257], dtype="<i4")
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, constrained=True, seed=len(rid))
    return Prompt(rid, rows.tobytes(), len(rows), sp)


def test_requests_beyond_the_kv_pages_wait_in_the_engine_and_all_finish(program) -> None:
    per_request = pages_for(36 + 1, 16)
    limits = GpuWorkerSettings(max_batch_size=8, max_context=200, page_size=16, num_pages=1 + 2 * per_request)
    eng = Engine(program, limits)
    for i in range(4):
        eng.add(prompt(f"r{i}", 36))
    most, done = 0, {}
    while eng.has_work():
        batch = eng.step()
        most = max(most, len(eng.running))
        assert eng.allocator.num_used <= 2 * per_request
        for f in batch.finished if batch else []:
            done[f.rid] = f
    assert most == 2, "pages for two requests: two run at a time, the others wait"
    assert {r: f.reason for r, f in done.items()} == {f"r{i}": FinishReason.LENGTH for i in range(4)}
    assert all(f.n_tokens == 36 - 8 for f in done.values())
    assert eng.allocator.num_free == eng.allocator.num_pages - 1 and eng.slots.num_free == 8


def test_a_deployment_with_few_kv_pages_queues_requests_and_completes_them_all() -> None:
    # 8 usable pages of 16 tokens; a 63-token context needs 4: two requests fit at a time.
    server = Server(
        "--tokenizer-workers", "1", "--num-pages", "9", "--page-size", "16", "--max-context", "63",
        "--lm-head", "full",  # the random model's full head: every request the same length of audio
    )  # fmt: skip
    try:
        results = asyncio.run(burst(server.base, 4))
        assert [status for status, _ in results] == [200] * 4, results
        assert len({n for _, n in results}) == 1 and results[0][1] > 0, "same budget, same audio length"
        _, ready = get_json(server.base + "/ready")
        assert ready["ready"] and all(p["state"] == "ready" for p in ready["processes"])
        metrics = asyncio.run(scrape(server.base))
        assert metrics['voxpipe_kv_pages_total{process="gpu_worker",role="gpu_worker"}'] == 8
        assert metrics['voxpipe_kv_pages_used{process="gpu_worker",role="gpu_worker"}'] == 0
        # A budget the whole cache cannot hold is refused up front (it could never start).
        code, body = asyncio.run(post(server.base, {"text": "Too long.", "max_tokens": 200}))
        assert code == 400 and b"max_tokens" in body
    finally:
        server.stop()


async def post(base: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/generate", json=body) as r:
            return r.status, await r.read()


async def burst(base: str, n: int) -> list[tuple[int, int]]:
    body = {"text": "Pages.", "max_tokens": 45, "min_tokens": 45, "seed": 3, "streaming": False}
    results = await asyncio.gather(*(post(base, body) for _ in range(n)))
    return [(code, len(payload) - 44 if code == 200 else payload) for code, payload in results]


async def scrape(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        for _ in range(100):  # the heartbeat after the last step carries the freed pages
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            lines = dict(x.rsplit(" ", 1) for x in text.splitlines() if x.startswith("voxpipe_kv_pages"))
            if lines.get('voxpipe_kv_pages_used{process="gpu_worker",role="gpu_worker"}') == "0.0":
                break
            await asyncio.sleep(0.05)
    return {k: float(v) for k, v in lines.items()}
