"""A bounded soak at about twice what fits: a small deployment (4 streams, 4 queued) under closed-loop
clients twice as many as it can hold. No process dies or restarts, every refusal is 503/429 with
Retry-After, every accepted request ends with its full audio, and no process's memory grows
between the first and the second half."""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import numpy as np

from tests.conftest import Server, get_json

SOAK_S = 12.0
BODY = {"text": "Under load.", "max_tokens": 70, "min_tokens": 70, "seed": 7}  # fixed length
RSS_GROWTH_BOUND = 48 << 20  # bytes a process may grow by between the halves (allocator noise)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb << 10


def metric(base: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).rsplit(" ", 1)[1])


def pcm_samples(body: bytes) -> np.ndarray:
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt ", body[:64]
    return np.frombuffer(body[44:], dtype="<i2")


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.lengths: collections.Counter[int] = collections.Counter()


async def client(s: aiohttp.ClientSession, base: str, k: int, deadline: float, tally: Tally) -> None:
    streaming = k % 2 == 0
    while time.monotonic() < deadline:
        try:
            async with s.post(base + "/generate", json={**BODY, "streaming": streaming}) as r:
                payload = await r.read()
                status, headers = r.status, r.headers
        except aiohttp.ClientError as e:  # a broken stream: a request lost mid-way
            tally.outcomes["broken"] += 1
            tally.problems.append(f"client {k}: {type(e).__name__}: {e}")
            continue
        tally.outcomes[str(status)] += 1
        if status == 200:
            tally.lengths[len(pcm_samples(payload))] += 1
        elif status in (429, 503):
            if not headers.get("Retry-After", "").isdigit():
                tally.problems.append(f"{status} without Retry-After: {payload[:200]!r}")
            await asyncio.sleep(0.2)  # keep the pressure on (a polite client would wait Retry-After)
        else:
            tally.problems.append(f"{status}: {payload[:200]!r}")


async def soak(base: str, n_clients: int, pids: dict[str, int]) -> tuple[Tally, dict, dict]:
    tally = Tally()
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        clients = [asyncio.create_task(client(s, base, k, start + SOAK_S, tally)) for k in range(n_clients)]
        await asyncio.sleep(SOAK_S / 2)
        first = {name: rss(pid) for name, pid in pids.items()}
        await asyncio.gather(*clients)
    second = {name: rss(pid) for name, pid in pids.items()}
    return tally, first, second


def test_twice_the_capacity_gets_retry_after_and_loses_no_accepted_request() -> None:
    server = Server(
        "--tokenizer-workers", "1", "--max-batch-size", "4", "--max-queue", "4", "--queue-timeout", "15"
    )
    try:
        _, ready = get_json(server.base + "/ready")
        pids = {p["name"]: p["pid"] for p in ready["processes"]}
        pids["serve"] = server.proc.pid
        deadline = time.monotonic() + 10
        while (limit := metric(server.base, "voxpipe_stream_limit")) < 0:  # first heartbeat with it
            assert time.monotonic() < deadline, "the gpu_worker never reported its capacity"
            time.sleep(0.1)
        assert 1 <= limit <= 4, limit  # measured, or the batch size until measured
        n_clients = 2 * (4 + 4)  # twice what fits: 4 streams and 4 waiting
        tally, first, second = asyncio.run(soak(server.base, n_clients, pids))

        _, after = get_json(server.base + "/ready")
        assert after["ready"] is True
        assert {p["name"]: p["pid"] for p in after["processes"]} == {
            k: v for k, v in pids.items() if k != "serve"
        }, "a process died or was restarted"
        assert server.proc.poll() is None
        accepted, rejected = tally.outcomes["200"], tally.outcomes["503"] + tally.outcomes["429"]
        tried = sum(tally.outcomes.values())
        lost = tried - accepted - rejected
        growth = {name: second[name] - first[name] for name in first}
        print(
            f"\noverload soak: {n_clients} clients for {SOAK_S:.0f} s against {limit:g} streams + 4 queued: "
            f"{tried} requests tried, {accepted} accepted and complete, {rejected} refused with "
            f"Retry-After, {lost} lost; audio lengths {dict(tally.lengths)}; RSS growth (MiB) "
            + ", ".join(f"{n} {g / 2**20:+.1f}" for n, g in growth.items())
        )
        assert not tally.problems, tally.problems[:5]
        assert lost == 0
        assert accepted > 0 and rejected > 0, tally.outcomes  # it was overloaded, and it served
        # Same seed, same fixed token budget: every accepted request has the same, non-empty audio.
        assert len(tally.lengths) == 1 and next(iter(tally.lengths)) > 0, tally.lengths
        for name, g in growth.items():
            assert g < RSS_GROWTH_BOUND, f"{name} grew {g / 2**20:.1f} MiB in the second half"
    finally:
        server.stop()
