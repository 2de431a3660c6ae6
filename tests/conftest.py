"""Shared fixtures: a whole `voxpipe serve` on orpheus-tiny, and helpers to run single workers."""

from __future__ import annotations

import os

# Triton kernels (gpu_worker/runner/sample_kernel.py) run in Triton's interpreter on a machine
# without a CUDA GPU; it reads this when triton is first imported, so it is set before anything is.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio
import contextlib
import importlib
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.chatterbox_reference import REFERENCE_TORCHAUDIO, import_torchaudio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torchaudio for the reference tests (tests/chatterbox_reference.py: its registry wheel for this torch
# cannot load its C library without CUDA, so its Python parts are entered without it), the same for
# the whole session whatever runs first; where torchaudio is installed in the venv, an import of it
# that failed would also fail every module importing it (transformers' audio utilities do).
if importlib.util.find_spec("torchaudio") or os.path.isdir(REFERENCE_TORCHAUDIO):
    import_torchaudio()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures(...)`): the parity
    tests' tiny matrices run faster on one, and far faster on a loaded 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def gpu_dispatch(*names: str, greeting=None) -> Iterator[tuple]:
    """The gateway's dispatcher to gpu_workers and one worker-side credit channel per name, in a
    fresh event loop over ipc sockets in a temporary directory: → (loop, pool, {name: channel});
    all closed afterwards."""
    from common.ipc import Addresses
    from common.messages import Abort, GpuInMsg
    from common.pool import AsyncDispatchChannel, CreditWorkChannel

    d = tempfile.mkdtemp(prefix="vpdisp-")
    addrs = Addresses.local(d)
    loop = asyncio.new_event_loop()
    pool: AsyncDispatchChannel[GpuInMsg] = AsyncDispatchChannel(addrs.gpu_in, greeting=greeting)
    workers = {n: CreditWorkChannel(addrs.gpu_in, GpuInMsg, name=n, uncounted=(Abort,)) for n in names}
    try:
        yield loop, pool, workers
    finally:
        for chan in workers.values():
            chan.close()
        loop.run_until_complete(pool.aclose())
        loop.close()
        shutil.rmtree(d, ignore_errors=True)


def tiny_lm_on_one_thread(model: str, **program_kw) -> Iterator:
    """A module fixture's body: `model`'s program with its dummy LM loaded, yielded while torch runs
    on one thread (tiny matrices: faster on a loaded machine than a thread pool)."""
    import torch

    from programs import get_spec, load_program_class

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = load_program_class(model)(get_spec(model), load_format="dummy", **program_kw)
        p.load_lm()
        yield p
    finally:
        torch.set_num_threads(before)


def tiny_codec(model: str = "orpheus-tiny"):
    """`model`'s program (dummy weights) with its codec loaded, for the codec_worker's tests."""
    from programs import get_spec, load_program_class

    p = load_program_class(model)(get_spec(model), load_format="dummy")
    p.load_codec()
    return p


def interpreted_kernel(module: str, name: str):
    """`name` of the Triton kernel module `module`, for a test that runs it in Triton's interpreter
    (set above where there is no GPU); skips where triton is missing or the interpreter is off."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in Triton's interpreter (tests/conftest.py sets it where there is no GPU)")
    return getattr(importlib.import_module(module), name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            code, body = get_json(base + "/ready", timeout=2)
            if code == 200:
                return body
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server not ready after {timeout} s: {body}")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # 2-core CI: processes must not fight over threads
    return env


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "common.cli",
            "serve",
            "--model",
            "orpheus-tiny",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen([*cmd, *args], env={**worker_env(), **(env or {})}, cwd=ROOT)
        self.ready = wait_ready(self.base, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    # Always the shortest lead window: the default (adaptive) picks it from measured step times,
    # which would make a request's first frame depend on the machine's load.
    srv = Server("--tokenizer-workers", "2", "--first-chunk", "fastest")
    yield srv
    srv.stop()


def fp8_copy(program, lm_cls):
    """A program of `program`'s spec (CPU) whose LM (`lm_cls`) holds `program`'s weights with its
    projections in float8 (`lm_cls.quantize_fp8`, as `--quantization fp8` loads it)."""
    from programs import load_program_class

    p = load_program_class(program.spec["name"])(program.spec, load_format="dummy", quantization="fp8")
    lm = lm_cls(p.read_config("lm_config"))
    lm.load_state_dict(program.lm.state_dict())
    lm.quantize_fp8()
    p.lm = lm.eval()
    p.head_ids = program.head_ids
    p.load_prompts()
    return p
