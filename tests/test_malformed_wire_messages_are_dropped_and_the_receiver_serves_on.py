"""Hostile wire input, per receiving socket: garbage bytes, an unknown tag, and a struct of the wrong
type (or with wrong field types) sent over real ZMQ to each process's inbox. The receiver logs and
drops each one, stays up, and serves the next valid message: the gpu_worker (gpu_in, a pool
DEALER), the codec_worker (codec_in, PULL), a tokenizer worker (requests, a pool DEALER) and the
gateway (gateway_in PULL, and its two pool ROUTERs)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from common.config import GatewaySettings, ServeConfig, TokenizerSettings
from common.ipc import Addresses, PullChannel, PushChannel
from common.messages import (
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
    SamplingParams,
    WorkerReady,
)
from common.pool import AsyncDispatchChannel
from tests.conftest import ROOT, free_port, get_json, worker_env
from tests.test_gateway import make_addrs, rig, start_rig  # noqa: F401 (fixtures)
from tests.test_workers_over_zmq import prompt, ready, wait_for

_enc = msgspec.msgpack.Encoder()
GARBAGE = b"\xff\x00this is not msgpack\xc1\xc1"
UNKNOWN_TAG = _enc.encode(["no-such-tag", "x", 1])


def hostile(wrong_type: object) -> list[bytes]:
    """Garbage, an unknown tag, a message of another socket's union, the right tag with junk fields."""
    return [GARBAGE, UNKNOWN_TAG, _enc.encode(wrong_type), _enc.encode(["prompt", 1, 2, "three", None])]


@pytest.fixture
def addrs(tmp_path: Path) -> Addresses:
    return Addresses.local(str(tmp_path / "run"))


class Proc:
    """A worker process with its log in a file (to check that it said what it dropped)."""

    def __init__(self, role: str, addrs: Addresses, log: Path, **settings: object) -> None:
        cfg = ServeConfig(model="orpheus-tiny", addresses=addrs, device="cpu", **settings)
        cfg.codec.device = "cpu"
        argv = [sys.executable, "-m", role, "--config-json", cfg.to_json(), "--name", role]
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            argv, env=worker_env(), cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT
        )

    def dropped(self) -> int:
        return self.log.read_text(errors="replace").count("dropped a malformed")

    def stop(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self._out.close()


def wait_dropped(proc: Proc, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while proc.dropped() < n:
        assert proc.popen.poll() is None, f"the receiver died:\n{proc.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"logged {proc.dropped()} drops, want {n}"
        time.sleep(0.05)


def test_codec_worker_drops_malformed_detok_batches_and_decodes_the_next(addrs, tmp_path) -> None:
    inbox: PullChannel = PullChannel(addrs.gateway_in, GatewayInMsg, bind=True)
    proc = Proc("codec_worker", addrs, tmp_path / "codec.log")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        wait_for(inbox, ready("codec_worker"))
        raw.connect(addrs.codec_in)
        bad = hostile(GenerateRequest("r", "hi", SamplingParams()))
        for data in bad:
            raw.send(data)
        wait_dropped(proc, len(bad))
        tokens = (np.arange(28) % 7 * 4096 + 128266 + 5).astype("<i4").tobytes()
        to_codec: PushChannel = PushChannel(addrs.codec_in)
        to_codec.send(
            DetokBatch([DetokChunk("ok", 0, 9, tokens, 0)], [Finished("ok", FinishReason.STOP, 28, 1)])
        )
        msgs = wait_for(inbox, lambda m: isinstance(m, AudioChunks) and m.finished)
        assert any(
            c.rid == "ok" and len(c.pcm) > 0 for m in msgs if isinstance(m, AudioChunks) for c in m.chunks
        )
        assert proc.popen.poll() is None
        to_codec.close()
    finally:
        raw.close()
        proc.stop()
        inbox.close()


def _pool_receiver_case(
    role: str, addrs: Addresses, tmp_path: Path, addr: str, valid: object, expect
) -> None:
    """A pool worker (gpu_worker on gpu_in, tokenizer on requests): the test is its dispatcher, sends
    hostile frames straight to its identity, then one valid message through the pool."""
    inbox: PullChannel = PullChannel(addrs.gateway_in, GatewayInMsg, bind=True)
    codec_in = PullChannel(addrs.codec_in, DetokBatch, bind=True) if role == "gpu_worker" else None
    loop = asyncio.new_event_loop()
    pool: AsyncDispatchChannel = AsyncDispatchChannel(addr)
    proc = Proc(role, addrs, tmp_path / f"{role}.log")
    try:
        wait_for(inbox, ready(role))

        async def attack_then_serve() -> None:
            pool.start()
            deadline = time.monotonic() + 10
            while not pool.workers:  # its WorkerReady
                assert time.monotonic() < deadline, "the worker never joined the pool"
                await asyncio.sleep(0.02)
            ident = next(iter(pool.workers))
            bad = hostile(WorkerReady("x", 0, 1))
            for data in bad:
                assert pool._send_now(ident, data)
            while proc.dropped() < len(bad):
                assert proc.popen.poll() is None, proc.log.read_text()[-3000:]
                await asyncio.sleep(0.05)
            await asyncio.wait_for(pool.send(valid), 10)

        loop.run_until_complete(attack_then_serve())
        expect(inbox, codec_in)
        assert proc.popen.poll() is None
    finally:
        proc.stop()
        loop.run_until_complete(pool.aclose())
        loop.close()
        inbox.close()
        if codec_in is not None:
            codec_in.close()


def test_gpu_worker_drops_malformed_pool_messages_and_runs_the_next_prompt(addrs, tmp_path) -> None:
    def expect(inbox: PullChannel, codec_in: PullChannel | None) -> None:
        assert codec_in is not None
        wait_for(codec_in, lambda b: any(f.rid == "ok" for f in b.finished))

    _pool_receiver_case(
        "gpu_worker", addrs, tmp_path, addrs.gpu_in, prompt("ok", "Hi.", max_tokens=60), expect
    )


def test_tokenizer_worker_drops_malformed_pool_messages_and_builds_the_next_prompt(addrs, tmp_path) -> None:
    def expect(inbox: PullChannel, codec_in: PullChannel | None) -> None:
        wait_for(inbox, lambda m: isinstance(m, Prompt) and m.rid == "ok")

    valid = GenerateRequest("ok", "Hello world", SamplingParams(max_tokens=300), {"voice": "zoe"})
    _pool_receiver_case("tokenizer_worker", addrs, tmp_path, addrs.requests, valid, expect)


def test_gateway_drops_malformed_messages_on_each_socket_and_serves_on(addrs, tmp_path) -> None:
    port = free_port()
    proc = Proc(
        "gateway",
        addrs,
        tmp_path / "gateway.log",
        gateway=GatewaySettings(port=port),
        tokenizer=TokenizerSettings(workers=1),
    )
    base = f"http://127.0.0.1:{port}"
    ctx = zmq.Context.instance()
    socks = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get_json(base + "/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.popen.poll() is None, proc.log.read_text()[-3000:]
            time.sleep(0.1)
        push = ctx.socket(zmq.PUSH)
        push.connect(addrs.gateway_in)
        sent = 0
        for data in hostile(DetokBatch([])):
            push.send(data)
            sent += 1
        for addr in (addrs.requests, addrs.gpu_in):  # the pool ROUTERs: junk from a would-be worker
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(addr)
            for data in hostile(GenerateRequest("r", "hi", SamplingParams())):
                dealer.send(data)
                sent += 1
            dealer.send_multipart([b"two", b"frames"])  # a pool message is one frame
            socks.append(dealer)
        socks.append(push)
        wait_dropped(proc, sent + 2)
        # Still serving: the next valid status shows in /ready (sent as a heartbeat is, repeatedly:
        # a fresh PUSH socket may not be connected yet when its first send goes).
        status = PushChannel(addrs.gateway_in)
        socks.append(status._sock)
        deadline = time.monotonic() + 10
        while not any(p["pid"] == 77 for p in get_json(base + "/ready")[1]["processes"]):
            assert time.monotonic() < deadline, "the gateway did not take the valid status"
            status.send(
                ProcStatus(
                    name="codec_worker", role="codec_worker", pid=77, state=ProcState.READY, time=time.time()
                )
            )
            time.sleep(0.1)
        assert proc.popen.poll() is None
    finally:
        for s in socks:
            s.close(linger=0)
        proc.stop()


# A prompt that decodes but does not add up (its bytes are not n_rows rows) is stopped at the
# gateway, which routes every prompt: the gpu_worker is never handed one it cannot read.


async def test_an_inconsistent_prompt_fails_its_request_and_never_reaches_a_gpu_worker(rig) -> None:  # noqa: F811
    task = rig.post(json={"text": "hi", "streaming": False})
    req = await rig.workers.next_request()
    await rig.workers.send(Prompt(req.rid, b"abc", 5, req.sampling))
    resp = await task
    body = await resp.json()
    assert resp.status == 500 and "inconsistent prompt" in body["error"], body
    with pytest.raises(asyncio.TimeoutError):  # nothing but (at most) the request's Abort
        while True:
            msg = await rig.workers.next_gpu_msg(timeout=0.5)
            assert not isinstance(msg, Prompt), msg
