"""CURVE on tcp:// (`voxpipe keys DIR`, then `--zmq-curve-dir DIR`): sockets made with the keys
exchange messages, encrypted; a peer without an authorized key, or without CURVE at all, gets
nothing through. Over tcp on 127.0.0.1, through the one socket factory, and through a real worker."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from common import ipc
from common.config import ServeConfig
from common.ipc import Addresses, PullChannel, PushChannel
from common.messages import GatewayInMsg, ProcState, ProcStatus, RequestError
from common.pool import WorkChannel
from tests.conftest import ROOT, free_port, worker_env

ERR = RequestError("r1", 400, "hello over curve")


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[Path]:
    key_dir = tmp_path / "keys"
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "keys", str(key_dir)],
        env=worker_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--zmq-curve-dir" in out.stderr
    ipc.use_curve(str(key_dir))
    yield key_dir
    ipc.use_curve("")


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_keys_are_private_and_a_second_run_keeps_them(keys: Path) -> None:
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(keys / secret).st_mode) == 0o600
    before = (keys / "server.key_secret").read_bytes()
    assert ipc.create_curve_keys(str(keys)) == []
    assert (keys / "server.key_secret").read_bytes() == before
    assert (keys / "authorized" / "client.key").exists()


def test_sockets_with_the_keys_exchange_messages(keys: Path) -> None:
    addr = tcp()
    inbox: PullChannel = PullChannel(addr, GatewayInMsg, bind=True)
    out: PushChannel = PushChannel(addr)
    try:
        out.send(ERR)
        assert inbox.recv(timeout_ms=5000) == ERR
    finally:
        out.close()
        inbox.close()


def test_the_pool_sockets_use_the_keys_too(keys: Path) -> None:
    addr = tcp()
    ctx = zmq.Context.instance()
    router = ipc.make_socket(ctx, zmq.ROUTER, addr, bind=True)  # the dispatcher's side, as pool.py makes it
    worker: WorkChannel = WorkChannel(addr, GatewayInMsg, name="w")
    try:
        assert worker.recv(timeout_ms=50) is None  # sends its WorkerReady
        assert router.poll(5000), "the worker's announcement did not get through"
        ident, _ = router.recv_multipart()
        router.send_multipart([ident, msgspec.msgpack.encode(ERR)])
        assert worker.recv(timeout_ms=5000) == ERR
    finally:
        worker.close()
        router.close(linger=0)


def _stranger(addr: str, keys: Path, curve: bool) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:  # a client keypair of its own, not in authorized/, but the right server key
        public, secret = zmq.auth.create_certificates(str(keys.parent), "stranger")
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret)
        sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
    sock.connect(addr)
    return sock


@pytest.mark.parametrize("curve", [True, False], ids=["unauthorized key", "no curve"])
def test_a_peer_without_an_authorized_key_gets_nothing_through(keys: Path, curve: bool) -> None:
    addr = tcp()
    inbox: PullChannel = PullChannel(addr, GatewayInMsg, bind=True)
    stranger = _stranger(addr, keys, curve)
    friend: PushChannel = PushChannel(addr)
    try:
        for _ in range(5):
            try:
                stranger.send(msgspec.msgpack.encode(RequestError("evil", 500, "let me in")), zmq.NOBLOCK)
            except zmq.Again:
                pass  # never connected: nothing to queue on
        friend.send(ERR)
        got = [inbox.recv(timeout_ms=2000) for _ in range(2)]
        assert got == [ERR, None], got
    finally:
        stranger.close(linger=0)
        friend.close()
        inbox.close()


def test_a_worker_given_the_keys_reports_over_curve(keys: Path, tmp_path: Path) -> None:
    """A real tokenizer worker with --zmq-curve-dir: its heartbeats reach a CURVE inbox."""
    addrs = Addresses.tcp(ports={f: free_port() for f in ("requests", "gateway_in", "gpu_in", "codec_in")})
    inbox: PullChannel = PullChannel(addrs.gateway_in, GatewayInMsg, bind=True)
    cfg = ServeConfig(model="orpheus-tiny", addresses=addrs, zmq_curve_dir=str(keys))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenizer_worker", "--config-json", cfg.to_json(), "--name", "tok"],
        env=worker_env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            msg = inbox.recv(timeout_ms=200)
            if isinstance(msg, ProcStatus) and msg.state == ProcState.READY:
                break
            assert time.monotonic() < deadline and proc.poll() is None, "no status over CURVE"
    finally:
        proc.kill()
        proc.wait()
        inbox.close()
