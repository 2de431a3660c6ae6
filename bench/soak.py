"""Soak: twice the server's capacity for ten minutes, with clients that hang up and a process of each
kind killed along the way; every accepted request must end complete or with an explicit error, and
no KV page may stay held at the end.

It starts `voxpipe serve` (orpheus-tiny on the CPU by default; arguments after `--` go to serve),
reads the stream capacity the gpu_worker measures, and runs 2 × that many closed-loop clients. Each
client sends `POST /generate` (streaming or not, random lengths) and hangs up on a fraction of its
requests at a random moment. At 20, 40, 60 and 80 % of the run it SIGKILLs the tokenizer worker, the
codec_worker, the gpu_worker and the gateway (pids from /ready), and waits for the supervisor to
bring the deployment back. At the end it lets the requests in flight finish and reads /metrics.

Each request ends as one of:
- complete: 200 and all its audio (a streamed WAV whose chunked body ended cleanly, or a whole WAV);
- error: an explicit error: a 4xx/5xx with a JSON body, or a stream the gateway broke on a failure;
- rejected: refused by admission (503 with Retry-After) before it was accepted;
- hung_up: the client hung up on purpose;
- gateway_killed: in flight on the gateway that was killed (its connection dropped);
- lost: anything else: no answer within `--request-timeout`, a connection error outside the
  gateway's kill, a 200 with no audio. The soak passes when this is 0 and no pages are held.

    python -m bench.soak --duration 600 --out soak.json -- --threads 1

It prints one JSON object (also written to `--out`) and exits 1 when it does not pass.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = ("tokenizer_worker", "codec_worker", "gpu_worker", "gateway")
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards quietly hum".split()


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def wait_ready(base: str, timeout_s: float) -> float:
    """Seconds until /ready says ready; raises TimeoutError."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        code, _ = get_json(base + "/ready")
        if code == 200:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s")


def wait_gone(base: str, pid: int, timeout_s: float) -> None:
    """Until /ready no longer shows `pid` ready (the gateway's own pid: until it answers again)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        code, ready = get_json(base + "/ready")
        rows = ready.get("processes", [])
        if code != 200 or not any(p.get("pid") == pid and p.get("state") == "ready" for p in rows):
            return
        time.sleep(0.05)


def metrics(base: str) -> dict[str, float]:
    """voxpipe_* gauges summed over processes."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("voxpipe_") and " " in line:
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            try:
                out[name] += float(value)
            except ValueError:
                pass
    return dict(out)


class Soak:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.lost: list[str] = []
        self.errors: collections.Counter[str] = collections.Counter()  # status and message → count
        self.stop_at = 0.0
        self.gateway_killed_at: float | None = None
        self.audio_s = 0.0

    def body(self, rng: random.Random) -> dict:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        max_tokens = rng.randint(self.args.max_tokens // 2, self.args.max_tokens)
        return {
            "text": words.capitalize() + ".",
            "max_tokens": max_tokens,
            "min_tokens": max_tokens - 80,  # past the prompt: audio of a known length
            "seed": rng.randint(0, 1 << 20),
            "streaming": rng.random() < 0.8,
        }

    async def client(self, s: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while time.monotonic() < self.stop_at:
            hang_up = rng.random() < self.args.hang_up
            outcome = await self.one(s, self.body(rng), rng.uniform(0.05, 2.0) if hang_up else None)
            self.outcomes[outcome] += 1
            if outcome == "rejected":
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    async def one(self, s: aiohttp.ClientSession, body: dict, hang_up_after: float | None) -> str:
        t0 = time.monotonic()
        limit = self.args.request_timeout if hang_up_after is None else hang_up_after
        try:
            return await asyncio.wait_for(self._send(s, body), limit)
        except asyncio.TimeoutError:
            if hang_up_after is not None:
                return "hung_up"  # the cancelled request closed its connection
            self.lost.append(f"no end within {self.args.request_timeout:g} s: {body}")
            return "lost"
        except aiohttp.ClientConnectorError:
            return "rejected"  # the gateway is restarting: nothing was accepted
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            killed = self.gateway_killed_at
            if killed is not None and t0 <= killed + 1.0 and time.monotonic() >= killed:
                return "gateway_killed"
            if isinstance(e, aiohttp.ClientPayloadError):
                self.errors["broken stream"] += 1
                return "error"  # the gateway broke the stream on a failure (its only way mid-stream)
            self.lost.append(f"{type(e).__name__}: {e}")
            return "lost"

    async def _send(self, s: aiohttp.ClientSession, body: dict) -> str:
        async with s.post(self.base + "/generate", json=body) as r:
            if r.status != 200:
                payload = await r.read()
                if r.status == 503 and "Retry-After" in r.headers:
                    return "rejected"
                try:
                    error = json.loads(payload).get("error")
                except (ValueError, AttributeError):
                    self.lost.append(f"{r.status} without a JSON error: {payload[:100]!r}")
                    return "lost"
                message = error.get("message", "") if isinstance(error, dict) else str(error)
                self.errors[f"{r.status} {message[:70]}"] += 1
                return "error"
            n = 0
            async for chunk in r.content.iter_any():
                n += len(chunk)
            if n <= 44:
                self.lost.append(f"200 with no audio: {body}")
                return "lost"
            self.audio_s += (n - 44) / 2 / 24000
            return "complete"

    async def kills(self) -> list[dict]:
        done = []
        duration = self.args.duration
        for i, role in enumerate(KILLS):
            await asyncio.sleep(max(0.0, self.stop_at - duration * (1 - (i + 1) / 5) - time.monotonic()))
            _, ready = await asyncio.to_thread(get_json, self.base + "/ready")
            pids = [p["pid"] for p in ready.get("processes", []) if p["role"] == role and p.get("pid")]
            if not pids:
                done.append({"role": role, "killed": False})
                continue
            if role == "gateway":
                self.gateway_killed_at = time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            await asyncio.to_thread(wait_gone, self.base, pids[0], 10)
            try:
                back = await asyncio.to_thread(wait_ready, self.base, 120)
            except TimeoutError:
                back = float("inf")
            done.append({"role": role, "pid": pids[0], "ready_again_s": round(back, 1)})
            print(f"killed {role} (pid {pids[0]}); ready again after {back:.1f} s", file=sys.stderr)
        return done

    async def run(self, clients: int) -> list[dict]:
        self.stop_at = time.monotonic() + self.args.duration
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            killer = asyncio.create_task(self.kills())
            await asyncio.gather(*(self.client(s, i) for i in range(clients)))
            return await killer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="orpheus-tiny")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--load", type=float, default=2.0, help="clients per stream of capacity (default 2)")
    p.add_argument("--hang-up", type=float, default=0.15, help="share of requests the client hangs up on")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--request-timeout", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("serve_args", nargs="*", help="after --: more `voxpipe serve` arguments")
    args = p.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "common.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--device", "cpu", "--tokenizer-workers", "2", *args.serve_args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        wait_ready(base, 600)
        time.sleep(3)  # the gpu_worker's first capacity estimate
        capacity = metrics(base).get("voxpipe_stream_capacity", 0.0) or 8.0
        clients = max(2, round(args.load * capacity))
        print(f"capacity {capacity:g} streams: {clients} clients for {args.duration:g} s", file=sys.stderr)
        soak = Soak(args, base)
        t0 = time.monotonic()
        kills = asyncio.run(soak.run(clients))
        time.sleep(5)  # aborts of the last hang-ups reach the gpu_worker
        end = metrics(base)
        result = {
            "model": args.model,
            "duration_s": round(time.monotonic() - t0, 1),
            "capacity": capacity,
            "clients": clients,
            "outcomes": dict(soak.outcomes),
            "accepted": sum(v for k, v in soak.outcomes.items() if k != "rejected"),
            "audio_s": round(soak.audio_s, 1),
            "kills": kills,
            "errors": dict(soak.errors.most_common(12)),
            "lost_examples": soak.lost[:10],
            "kv_pages_used_at_end": end.get("voxpipe_kv_pages_used"),
            "active_streams_at_end": end.get("voxpipe_active_streams"),
        }
        result["passed"] = soak.outcomes["lost"] == 0 and not result["kv_pages_used_at_end"]
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0 if result["passed"] else 1
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
