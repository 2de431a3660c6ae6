"""Each worker process alone, driven over real ZMQ sockets with the real message types: the test
binds the sockets the worker's neighbours would and plays their part."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings, ServeConfig
from common.ipc import Addresses, PullChannel, PushChannel
from common.messages import (
    Abort,
    AudioChunks,
    DetokBatch,
    DetokChunk,
    Finished,
    FinishReason,
    GatewayInMsg,
    GenerateRequest,
    ProcState,
    ProcStatus,
    Prompt,
    RequestError,
    SamplingParams,
)
from common.pool import AsyncDispatchChannel
from programs import get_spec, load_program_class
from tests.conftest import ROOT, worker_env

SPEC = get_spec("orpheus-tiny")


@pytest.fixture
def addrs(tmp_path) -> Addresses:
    return Addresses.local(str(tmp_path / "run"))


def start(role: str, addrs: Addresses, **settings) -> subprocess.Popen:
    cfg = ServeConfig(model="orpheus-tiny", addresses=addrs, device="cpu", **settings)
    cfg.codec.device = "cpu"
    cfg.gpu.lm_head = "full"  # the whole vocabulary: windows of the random model's rows, as counted below
    argv = [sys.executable, "-m", role, "--config-json", cfg.to_json(), "--name", role]
    return subprocess.Popen(argv, env=worker_env(), cwd=ROOT)


def wait_for(inbox: PullChannel, pred, timeout: float = 60.0) -> list:
    """Messages received until one satisfies pred (inclusive)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = inbox.recv(timeout_ms=200)
        if msg is not None:
            got.append(msg)
            if pred(msg):
                return got
    raise TimeoutError(f"condition not met; received {[type(m).__name__ for m in got]}")


@pytest.fixture
def gateway_inbox(addrs) -> Iterator[PullChannel]:
    inbox: PullChannel[GatewayInMsg] = PullChannel(addrs.gateway_in, GatewayInMsg, bind=True)
    yield inbox
    inbox.close()


def ready(name: str):
    return lambda m: isinstance(m, ProcStatus) and m.name == name and m.state == ProcState.READY


def prompt(rid: str, text: str, max_tokens: int, seed: int = 1) -> Prompt:
    program = load_program_class("orpheus-tiny")(SPEC)
    rows = program.preprocess(text, {}).astype("<i4")
    sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=seed, max_tokens=max_tokens)
    sp.constrained = True
    return Prompt(rid, rows.tobytes(), len(rows), sp)


class GpuPool:
    """The gateway's side of the gpu pool (a dispatcher bound on gpu_in), driven synchronously."""

    def __init__(self, addrs: Addresses) -> None:
        self.loop = asyncio.new_event_loop()
        self.chan: AsyncDispatchChannel = AsyncDispatchChannel(addrs.gpu_in)
        self.pending: list[asyncio.Task] = []

    def send(self, *prompts: Prompt) -> None:
        """Queue prompts; each goes out once a gpu_worker has credit for it."""

        async def go() -> None:
            self.pending += [asyncio.ensure_future(self.chan.send(p)) for p in prompts]

        self.loop.run_until_complete(go())

    def run(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def abort(self, *rids: str) -> int:
        async def go() -> int:
            return self.chan.broadcast(Abort(list(rids)))

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.chan.aclose())
        self.loop.close()


def test_gpu_worker_streams_chunks_and_honours_abort(addrs, gateway_inbox):
    codec_inbox: PullChannel[DetokBatch] = PullChannel(addrs.codec_in, DetokBatch, bind=True)
    pool = GpuPool(addrs)
    proc = start("gpu_worker", addrs)
    try:
        wait_for(gateway_inbox, ready("gpu_worker"))
        pool.send(prompt("short", "Hi.", max_tokens=80), prompt("long", "Hello.", max_tokens=400))
        pool.run(0.5)
        assert pool.chan.dispatched["gpu_worker"] == 2
        batches = wait_for(codec_inbox, lambda b: any(f.rid == "short" for f in b.finished))
        chunks = [c for b in batches for c in b.chunks if c.rid == "short"]
        fin = next(f for b in batches for f in b.finished if f.rid == "short")
        assert fin.reason == FinishReason.LENGTH and fin.n_chunks == len(chunks) > 0
        assert [c.index for c in chunks] == list(range(len(chunks)))
        for c in chunks:  # regular windows of 28 rows; the first may be a lead of 7, 14 or 21
            tok = np.frombuffer(c.tokens, dtype="<i4")
            assert len(tok) in (7, 14, 21, 28) and (len(tok) == 28 or c.index == 0)
            codes = tok - 128266 - 4096 * (np.arange(len(tok)) % 7)
            assert ((codes > 0) & (codes < 4096)).all(), "constrained tokens are valid codes"
        assert pool.abort("long") == 1
        batches = wait_for(codec_inbox, lambda b: any(f.rid == "long" for f in b.finished))
        fin = next(f for b in batches for f in b.finished if f.rid == "long")
        assert fin.reason == FinishReason.ABORT
    finally:
        proc.kill()
        codec_inbox.close()
        pool.close()


def test_a_full_gpu_worker_is_sent_no_prompt_until_a_slot_frees(addrs, gateway_inbox):
    codec_inbox: PullChannel[DetokBatch] = PullChannel(addrs.codec_in, DetokBatch, bind=True)
    pool = GpuPool(addrs)
    proc = start("gpu_worker", addrs, gpu=GpuWorkerSettings(max_batch_size=2))
    try:
        wait_for(gateway_inbox, ready("gpu_worker"))
        pool.send(*(prompt(f"r{i}", "Hello.", max_tokens=1000) for i in range(3)))
        pool.run(1.5)  # more than a re-announcement period: the worker says it is full
        assert pool.chan.dispatched["gpu_worker"] == 2, "a worker with 2 slots took a third prompt"
        assert [t.done() for t in pool.pending] == [True, True, False]
        assert pool.abort("r0") == 1  # frees a slot: the waiting prompt goes out
        deadline = time.monotonic() + 10
        while not pool.pending[2].done():
            assert time.monotonic() < deadline, "the freed slot was not offered again"
            pool.run(0.05)
        assert pool.chan.dispatched["gpu_worker"] == 3
        pool.abort("r1", "r2")
        wait_for(codec_inbox, lambda b: any(f.rid == "r2" for f in b.finished))
    finally:
        proc.kill()
        codec_inbox.close()
        pool.close()


def test_codec_worker_decodes_chunks_in_order_then_finishes(addrs, gateway_inbox):
    proc = start("codec_worker", addrs)
    try:
        wait_for(gateway_inbox, ready("codec_worker"))
        rng = np.random.default_rng(0)
        codes = rng.integers(1, 4096, size=(3, 28))
        tokens = (codes + 128266 + 4096 * (np.arange(28) % 7)).astype("<i4")
        chunks = [DetokChunk("r", i, 9, tokens[i].tobytes(), i) for i in range(3)]
        to_codec: PushChannel = PushChannel(addrs.codec_in)
        to_codec.send(DetokBatch(chunks, [Finished("r", FinishReason.STOP, 30, 3)]))
        msgs = wait_for(gateway_inbox, lambda m: isinstance(m, AudioChunks) and m.finished)
        out = next(m for m in msgs if isinstance(m, AudioChunks))
        assert [c.index for c in out.chunks] == [0, 1, 2]
        assert all(len(c.pcm) == 2048 * 2 for c in out.chunks)
        assert out.finished[0].rid == "r"
        # The same chunks decoded in this process give the same PCM: seeded noise, no hidden state.
        program = load_program_class("orpheus-tiny")(SPEC)
        program.load_codec()
        local = Codec(program).decode(chunks)
        for mine, theirs in zip(local, out.chunks, strict=True):
            a, b = (np.frombuffer(x.pcm, dtype="<i2").astype(np.int32) for x in (mine, theirs))
            assert np.abs(a - b).max() <= 1, "equal up to the last bit of PCM16 (thread counts differ)"
    finally:
        proc.kill()


def test_tokenizer_worker_builds_prompts_and_reports_bad_ones(addrs, gateway_inbox):
    loop = asyncio.new_event_loop()
    to_pool: AsyncDispatchChannel = AsyncDispatchChannel(addrs.requests)  # the gateway's side
    proc = start("tokenizer_worker", addrs)
    try:
        wait_for(gateway_inbox, ready("tokenizer_worker"))
        sp = SamplingParams(max_tokens=300)

        async def submit() -> None:
            # Returns once the worker took both: it asks for the second after building the first.
            ok = to_pool.send(GenerateRequest("ok", "Hello world", sp, {"voice": "zoe"}))
            bad = to_pool.send(GenerateRequest("bad", "Hello world", sp, {"voice": "nobody"}))
            await asyncio.wait_for(asyncio.gather(ok, bad), 30)

        loop.run_until_complete(submit())
        got = [m for m in wait_for(gateway_inbox, lambda m: isinstance(m, Prompt)) if isinstance(m, Prompt)]
        expected = load_program_class("orpheus-tiny")(SPEC).preprocess("Hello world", {"voice": "zoe"})
        assert got[0].rid == "ok"
        assert np.array_equal(np.frombuffer(got[0].tokens, dtype="<i4"), expected.reshape(-1))
        errs = wait_for(gateway_inbox, lambda m: isinstance(m, RequestError))
        err = errs[-1]
        assert err.rid == "bad" and err.status == 400 and "tara" in err.message
    finally:
        proc.kill()
        loop.run_until_complete(to_pool.aclose())
        loop.close()
