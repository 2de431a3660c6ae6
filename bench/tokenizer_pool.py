"""Prompts built per second by a tokenizer pool of 1, 2, 4 workers behind the gateway's dispatcher.

    python bench/tokenizer_pool.py [--model orpheus-tiny] [--requests 2000] [--workers 1 2 4]
                                   [--work-ms 0]

Real `python -m tokenizer_worker` processes over ipc://, the real `AsyncDispatchChannel`, and this
process collecting the Prompts in the gateway inbox's place. `--work-ms` adds that much (sleeping,
not CPU) to every prompt through the workers' test hook, to see how the pool scales when prompt
building is slower than the round trip (a long text on a real BPE tokenizer), even on few cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.ipc import Addresses, AsyncPullChannel  # noqa: E402
from common.messages import (  # noqa: E402
    GatewayInMsg,
    GenerateRequest,
    ProcState,
    ProcStatus,
    Prompt,
    SamplingParams,  # noqa: E402
)
from common.pool import AsyncDispatchChannel  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. "


async def run(n_workers: int, args: argparse.Namespace) -> float:
    d = tempfile.mkdtemp(prefix="vpbench-")
    a = Addresses.local(d)
    dispatch: AsyncDispatchChannel[GenerateRequest] = AsyncDispatchChannel(a.requests)
    gw_in: AsyncPullChannel[GatewayInMsg] = AsyncPullChannel(a.gateway_in, GatewayInMsg)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "VOXPIPE_LOG_LEVEL": "WARNING"}
    if args.work_ms:
        env["VOXPIPE_TEST_PROMPT_DELAY"] = f"={args.work_ms / 1000}"  # empty prefix: every prompt
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenizer_worker", "--model", args.model, "--name", f"tok{i}",
             "--requests", a.requests, "--gateway-in", a.gateway_in],
            env=env, cwd=ROOT,
        )
        for i in range(n_workers)
    ]  # fmt: skip
    try:
        ready: set[str] = set()
        while len(ready) < n_workers:
            msg = await asyncio.wait_for(gw_in.recv(), 120)
            if isinstance(msg, ProcStatus) and msg.state == ProcState.READY:
                ready.add(msg.name)
        await asyncio.sleep(1.5)  # every worker has announced itself free
        sp = SamplingParams(max_tokens=1200)
        t0 = time.perf_counter()
        sends = [
            asyncio.ensure_future(dispatch.send(GenerateRequest(f"r{i}", TEXT * 2, sp)))
            for i in range(args.requests)
        ]
        built = 0
        while built < args.requests:
            built += isinstance(await gw_in.recv(), Prompt)
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*sends)
        return args.requests / elapsed
    finally:
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + 10
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the dispatcher answers their WorkerLeaving meanwhile
        for chan in (dispatch, gw_in):
            chan.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="orpheus-tiny")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--work-ms", type=float, default=0.0, help="extra time per prompt (sleep)")
    args = ap.parse_args()
    print(f"{args.requests} prompts of {len(TEXT) * 2} chars, {args.model}, +{args.work_ms:g} ms each, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    base = None
    for n in args.workers:
        rate = asyncio.run(run(n, args))
        base = base or rate
        print(f"{n} worker(s): {rate:8.0f} prompts/s  ({rate / base:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
