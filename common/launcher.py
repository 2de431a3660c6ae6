"""`voxpipe serve`: start every process on one host, wait until all are ready, supervise them.

Children are plain `python -m <role>` processes given the same ServeConfig as JSON, talking over
ipc:// sockets in a private run directory, where each also binds its tap (`tap-<name>`). A state
file (`common.tap.state_path`) records the run directory and the taps, so `voxpipe tap` with no
address attaches to this server. Readiness is read from the gateway's /ready, which
collects every process's status; a child that dies is restarted (with a back-off, and a bound on
restarts so a crash loop ends the server with a clear message instead of spinning).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from common.config import ServeConfig
from common.ipc import Addresses, numbered
from common.mps import GPU_ROLES, mps_for
from common.proc import REFUSED
from common.tap import remove_state, write_state
from common.threads import thread_env

log = logging.getLogger("voxpipe.serve")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_RESTARTS = 5  # within RESTART_WINDOW_S, per child
# A process that exits with REFUSED (common.proc) refused to start for a reason a restart cannot
# change (a port in use, missing weights, a device torch cannot use): serve stops and exits with it.
RESTART_WINDOW_S = 60.0
# Run under the MPS daemon before the GPU processes: a CUDA client that works there means they will.
MPS_PROBE = [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"]


@dataclass
class Child:
    name: str
    role: str
    popen: subprocess.Popen | None = None
    args: list[str] = field(default_factory=list)  # per-child flags (a pair's codec_in, device)
    restarts: list[float] = field(default_factory=list)


def _state_text(proc: dict) -> str:
    """A process's state and detail, the state word once ("loading the LM on cpu", whose detail
    already says it, not "loading loading …")."""
    state, detail = str(proc.get("state", "")), str(proc.get("detail", "")).strip()
    return detail if detail.lower().startswith(state.lower()) and state else f"{state} {detail}".strip()


class Refused(RuntimeError):
    """A child refused to start (exit status REFUSED): serve stops with that status."""


def port_in_use(host: str, port: int) -> str:
    """Why the gateway could not listen on host:port ("" when it can): bound the way aiohttp binds
    (SO_REUSEADDR), so a port left in TIME_WAIT by a stopped server counts as free."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve --host {host!r}: {e}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return ""


class Supervisor:
    def __init__(self, cfg: ServeConfig) -> None:
        self.run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="voxpipe-")
        if cfg.addresses is None:
            cfg.addresses = Addresses.local(self.run_dir)
        self.cfg = cfg
        self.children = [Child("gateway", "gateway")]
        self.children += [
            Child(f"tokenizer_worker.{i}", "tokenizer_worker") for i in range(cfg.tokenizer.workers)
        ]
        self.children += self._pairs(cfg)
        self._stopping = False
        self.state_file = ""
        self.mps = mps_for(cfg.mps, self.run_dir)
        self.mps_probe = MPS_PROBE

    @staticmethod
    def _pairs(cfg: ServeConfig) -> list[Child]:
        """One gpu_worker and one codec_worker per GPU; with several, each pair has its own
        codec_in and device and numbered names (gpu_worker.0, codec_worker.0, ...)."""
        from common.config import pair_devices

        n = cfg.gpu_workers
        assert cfg.addresses is not None
        if n == 1:
            return [Child("gpu_worker", "gpu_worker"), Child("codec_worker", "codec_worker")]
        lm = pair_devices(cfg.device, n)
        codec = lm if cfg.codec.device == "auto" else pair_devices(cfg.codec.device, n)
        out = []
        for i in range(n):
            addr = ["--codec-in", numbered(cfg.addresses.codec_in, i), "--device", lm[i]]
            out.append(Child(f"gpu_worker.{i}", "gpu_worker", args=addr))
            out.append(Child(f"codec_worker.{i}", "codec_worker", args=[*addr, "--codec-device", codec[i]]))
        return out

    def tap_address(self, child: Child) -> str:
        return f"ipc://{os.path.join(self.run_dir, 'tap-' + child.name)}"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.gateway.host in ("0.0.0.0", "::", "") else self.cfg.gateway.host
        return f"http://{host}:{self.cfg.gateway.port}"

    def child_env(self, child: Child) -> dict[str, str]:
        env = dict(os.environ)
        if child.role != "gateway":
            env.pop("VOXPIPE_API_KEY", None)  # only the gateway checks it: no other process holds it
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update(thread_env(child.role, self.cfg))
        if self.mps is not None and child.role in GPU_ROLES:
            env.update(self.mps.env)
            if child.role == "codec_worker" and self.cfg.codec.gpu_share:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.cfg.codec.gpu_share)
        return env

    def _spawn(self, child: Child) -> None:
        env = self.child_env(child)
        argv = [sys.executable, "-m", child.role, "--config-json", self.cfg.to_json(), "--name", child.name]
        argv += ["--tap", self.tap_address(child), *child.args]
        child.popen = subprocess.Popen(argv, env=env)
        log.info("started %s (pid %d)", child.name, child.popen.pid)

    def start(self) -> None:
        if self.mps is not None:
            try:
                self.mps.start()
                self.mps.check(self.mps_probe)
            except RuntimeError as e:
                self.mps.stop()
                if self.cfg.mps == "on":
                    raise
                log.warning("%s; serving without MPS (--mps auto)%s", e,
                            ", so without --codec-gpu-share" if self.cfg.codec.gpu_share else "")  # fmt: skip
                self.mps = None
        for child in self.children:
            self._spawn(child)
        taps = {child.name: self.tap_address(child) for child in self.children}
        self.state_file = write_state(self.cfg.gateway.port, self.url, self.run_dir, self.cfg.model, taps)

    def ready_state(self) -> dict | None:
        try:
            # Named, so that the gateway logs these polls at DEBUG (gateway.__main__.AccessLog).
            req = urllib.request.Request(self.url + "/ready", headers={"User-Agent": "voxpipe-serve"})
            with urllib.request.urlopen(req, timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                return json.loads(e.read())
            except ValueError:
                return None
        except (OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Block until /ready says every process is ready, logging progress as it changes."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline and not self._stopping:
            for child in self.children:
                code = child.popen.poll() if child.popen else None
                if code == REFUSED:
                    raise Refused(f"{child.name} could not start; see its message above")
                if code is not None and code < 0 and len(child.restarts) < MAX_RESTARTS:
                    # Killed by a signal from outside (an operator, the OOM killer), not a failure of
                    # its own: start it again, as `supervise` would once all are ready.
                    log.error("%s was killed (signal %d) while starting; restarting it", child.name, -code)
                    child.restarts.append(time.monotonic())
                    self._spawn(child)
                    continue
                if code is not None:
                    raise RuntimeError(
                        f"{child.name} exited with status {code} while starting; see its log above"
                    )
            state = self.ready_state()
            if state is not None:
                summary = ", ".join(f"{p['name']}: {_state_text(p)}" for p in state["processes"])
                if summary != last:
                    log.info("%s", summary)
                    last = summary
                if state.get("ready"):
                    return
            time.sleep(0.2)
        if self._stopping:
            return
        raise TimeoutError(f"not ready after {timeout_s:.0f} s")

    def supervise(self) -> int:
        """Restart children that die; returns an exit status once asked to stop or given up."""
        while not self._stopping:
            for child in self.children:
                code = child.popen.poll() if child.popen else None
                if code is None:
                    continue
                if code == REFUSED:
                    log.error("%s refused to start again; stopping (see its message above)", child.name)
                    self.stop()
                    return REFUSED
                now = time.monotonic()
                child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(child.restarts) > MAX_RESTARTS:
                    log.error(
                        "%s died %d times within %.0f s; stopping", child.name, MAX_RESTARTS, RESTART_WINDOW_S
                    )
                    self.stop()
                    return 1
                log.error("%s exited with status %s; restarting it", child.name, code)
                time.sleep(min(0.2 * len(child.restarts), 2.0))
                self._spawn(child)
            time.sleep(0.1)
        return 0

    def stop(self) -> None:
        self._stopping = True
        for child in self.children:
            if child.popen and child.popen.poll() is None:
                child.popen.terminate()
        deadline = time.monotonic() + 5
        for child in self.children:
            if child.popen:
                try:
                    child.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.popen.kill()
                    child.popen.wait(5)
        if self.state_file:
            remove_state(self.state_file)
        if self.mps is not None:
            self.mps.stop()
        if not self.cfg.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def serve(cfg: ServeConfig) -> int:
    busy = port_in_use(cfg.gateway.host, cfg.gateway.port)
    if busy:  # before anything starts: another server's processes and state file stay untouched
        log.error("%s; is another server running there? choose another --port", busy)
        return REFUSED
    sup = Supervisor(cfg)

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        sup._stopping = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:  # whatever happens, the children and the MPS daemon go with the server
        try:
            sup.start()
            sup.wait_ready()
        except Refused as e:
            log.error("%s", e)
            return REFUSED
        except (RuntimeError, TimeoutError) as e:
            log.error("%s", e)
            return 1
        if sup._stopping:
            return 0
        log.info("voxpipe is ready: %s/generate (model %s)", sup.url, cfg.model)
        return sup.supervise()
    finally:
        sup.stop()
