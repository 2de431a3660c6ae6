"""Peers on tcp:// must authenticate, and what a status claims is bounded.

- A process whose addresses other hosts can reach (not ipc://, not loopback) and that has no CURVE
  keys refuses to start, naming `--zmq-curve-dir` (or the explicit `--zmq-insecure`).
- On a gateway with CURVE keys, a DEALER without an authorized key (none at all, or its own) gets
  no request from the tokenizer pool, and a status it pushes never reaches /ready; a worker with
  the keys takes the request.
- A status that claims a huge capacity does not raise the stream limit, and one with an unknown
  role, a name no process has, or metrics that are no sane numbers is dropped.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from aiohttp.test_utils import TestClient, TestServer

from common import ipc
from common.config import ServeConfig, TokenizerSettings
from common.ipc import Addresses, is_loopback, secure_sockets
from common.messages import GenerateRequest, ProcState, ProcStatus, WorkerReady
from common.pool import AsyncWorkChannel
from gateway.procs import MAX_SLOTS, ProcessTable
from gateway.server import GATEWAY, build_app
from tests.conftest import ROOT, free_port, worker_env
from tests.test_gateway import FakeWorkers

# -- what a status may claim -------------------------------------------------------------------------


def status(name: str, role: str = "gpu_worker", **kw) -> ProcStatus:
    return ProcStatus(name=name, role=role, pid=kw.pop("pid", 100), state=ProcState.READY, **kw)


def test_a_forged_status_does_not_raise_the_stream_limit() -> None:
    table = ProcessTable(tokenizer_workers=1)
    table.update(status("gpu_worker", capacity=16, metrics={"stream_capacity": 12.0}))
    assert table.stream_capacity() == 12.0
    table.update(status("gpu_worker.evil", capacity=1_000_000, metrics={"stream_capacity": 1_000_000.0}))
    table.update(status("gpu_worker", pid=101, capacity=MAX_SLOTS + 1))  # refused outright
    assert table.stream_capacity() == 12.0
    # Within the bounds, a second gpu_worker in a one-gpu_worker deployment does not add its slots,
    # and no worker counts more streams than its slots.
    table.update(status("gpu_worker.other", capacity=16, metrics={"stream_capacity": 9000.0}))
    assert table.stream_capacity() == 16.0


@pytest.mark.parametrize(
    "forged",
    [
        status("admin", role="root"),
        status("gpu_worker<script>"),
        status("x" * 200),
        status("gpu_worker.1", pid=0),
        status("gpu_worker.1", load=-1),
        status("gpu_worker.1", metrics={"kv_pages_used": float("nan")}),
        status("gpu_worker.1", metrics={"kv_pages_used": 1e300}),
        status("gpu_worker.1", metrics={"Bad Name!": 1.0}),
        status("gpu_worker.1", metrics={f"m{i}": 1.0 for i in range(100)}),
    ],
)
def test_a_status_no_real_process_sends_is_dropped(forged: ProcStatus) -> None:
    table = ProcessTable(tokenizer_workers=1)
    assert table.refusal(forged)
    table.update(forged)
    _, rows = table.report()
    assert forged.name not in {r["name"] for r in rows}
    assert table.stream_capacity() is None


def test_the_table_holds_a_bounded_number_of_processes_and_details() -> None:
    table = ProcessTable(tokenizer_workers=1)
    for i in range(2000):
        table.update(status(f"tokenizer_worker.{i}", role="tokenizer_worker", detail="d" * 10_000))
    _, rows = table.report()
    assert len(rows) <= 1 + 1024 + 2  # the gateway, the table, the missing pair
    assert max(len(r["detail"]) for r in rows) <= 501


# -- CURVE on by default where peers can be elsewhere --------------------------------------------------


def test_only_ipc_and_loopback_count_as_this_host() -> None:
    here = ["ipc:///tmp/x", "tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:2", "tcp://127.8.0.1:3"]
    elsewhere = ["tcp://*:5557", "tcp://0.0.0.0:1", "tcp://gateway:5557", "tcp://10.0.0.2:1", "tcp://[::]:1"]
    assert all(is_loopback(a) for a in here) and not any(is_loopback(a) for a in elsewhere)


def test_an_address_beyond_this_host_needs_keys_or_an_explicit_opt_out(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--zmq-curve-dir"):
        secure_sockets("", ["tcp://127.0.0.1:1", "tcp://gateway:5558"])
    secure_sockets("", ["tcp://gateway:5558"], insecure=True)
    secure_sockets("", ["ipc:///tmp/x", "tcp://127.0.0.1:1"])  # nothing to secure
    try:  # a directory that does not exist gets fresh keys, and they are used
        secure_sockets(str(tmp_path / "new"), ["tcp://gateway:5558"])
        assert (tmp_path / "new" / "authorized" / "client.key").exists()
        assert ipc.curve._curve is not None
    finally:
        ipc.use_curve("")


def test_a_gateway_reachable_from_other_hosts_without_keys_refuses_to_start() -> None:
    env = {**worker_env(), "VOXPIPE_REQUESTS": f"tcp://0.0.0.0:{free_port()}"}
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "--model", "orpheus-tiny", "--port", str(free_port())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--zmq-curve-dir" in out.stderr and "Traceback" not in out.stderr


# -- strangers on a CURVE gateway ----------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[Path]:
    key_dir = tmp_path / "keys"
    ipc.create_curve_keys(str(key_dir))
    ipc.use_curve(str(key_dir))
    yield key_dir
    ipc.use_curve("")


@pytest.fixture
async def curve_gateway(keys: Path) -> AsyncIterator[tuple[TestClient, FakeWorkers, Addresses]]:
    addrs = Addresses.tcp(ports={f: free_port() for f in Addresses.__struct_fields__})
    cfg = ServeConfig(model="orpheus-tiny", addresses=addrs, tokenizer=TokenizerSettings(workers=1))
    client = TestClient(TestServer(build_app(cfg)))
    await client.start_server()
    workers = FakeWorkers(addrs, tokenizer=False)  # made with the keys: the gpu pool, the inbox
    await workers.join_gpu_pool(client.app)
    await workers.announce(client.app, cfg.model)
    yield client, workers, addrs
    await client.close()
    workers.close()


def stranger(kind: int, addr: str, keys: Path, own_key: bool) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if own_key:  # a keypair of its own, not in authorized/, and the right server key
        _, secret = zmq.auth.create_certificates(str(keys.parent), f"stranger{kind}")
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret)
        sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
    if kind == zmq.DEALER:
        sock.setsockopt(zmq.ROUTING_ID, f"tokenizer_worker.evil{int(own_key)}/x".encode())
    sock.connect(addr)
    return sock


@pytest.mark.parametrize("own_key", [False, True], ids=["no curve", "unauthorized key"])
async def test_an_unauthenticated_peer_gets_no_request_and_forges_no_status(
    curve_gateway, keys: Path, own_key: bool
) -> None:
    client, workers, addrs = curve_gateway
    evil = stranger(zmq.DEALER, addrs.requests, keys, own_key)
    forger = stranger(zmq.PUSH, addrs.gateway_in, keys, own_key)
    enc = msgspec.msgpack.Encoder()
    try:
        for _ in range(10):  # "I am free", and a status claiming a huge capacity
            for sock, msg in (
                (evil, WorkerReady("tokenizer_worker.evil", 0, 1)),
                (forger, status("gpu_worker.evil", capacity=60_000)),
            ):
                try:
                    await sock.send(enc.encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            await asyncio.sleep(0.05)
        post = asyncio.create_task(client.post("/generate", json={"text": "Hello.", "streaming": False}))
        assert not await evil.poll(1500), "a peer without an authorized key was handed a request"
        gw = client.app[GATEWAY]
        assert "gpu_worker.evil" not in {r["name"] for r in gw.procs.report()[1]}
        assert not gw._send_to_tokenizers.workers, gw._send_to_tokenizers.workers
        # A worker with the keys takes it.
        friend = AsyncWorkChannel[GenerateRequest](addrs.requests, GenerateRequest, name="tokenizer_worker.0")
        try:
            req = await asyncio.wait_for(friend.recv(), 10)
            assert req.text == "Hello."
        finally:
            friend.close()
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
    finally:
        evil.close(linger=0)
        forger.close(linger=0)


def test_a_tap_on_tcp_shows_nothing_to_a_peer_without_the_keys(keys: Path) -> None:
    """A tap mirrors every request's text: on tcp:// it is a CURVE server like the other sockets."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    tap = ipc.Tap(addr, "gateway")
    ctx = zmq.Context.instance()
    friend, stranger = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    ipc.curve.apply(ctx, friend, bind=False)  # the deployment's client keys, as `voxpipe tap` uses them
    for sock in (friend, stranger):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(addr)
    try:
        deadline = time.monotonic() + 10
        while not friend.poll(50):  # subscriptions take a moment to reach the tap
            assert time.monotonic() < deadline, "the tap never reached a subscriber with the keys"
            tap.poll()
            tap.stage("r1", "submitted")
        assert not stranger.poll(500), "a subscriber without the keys saw the tap"
    finally:
        friend.close(linger=0)
        stranger.close(linger=0)
        tap.close()


def test_a_tap_reachable_from_other_hosts_needs_keys_too() -> None:
    from common.proc import secure

    cfg = ServeConfig(model="orpheus-tiny", addresses=Addresses.tcp())
    assert secure("gpu_worker", cfg) == ""
    assert "--zmq-curve-dir" in secure("gpu_worker", cfg, tap="tcp://*:5570")
