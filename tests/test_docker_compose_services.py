"""docker-compose.yml and the Dockerfile against the real CLI, and the compose topology run for real:
the same commands and environment as separate processes over tcp:// on this host (service names
mapped to localhost, ports to free ones), serving orpheus-tiny on the CPU."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import soundfile as sf
import yaml

from common.cli import ROLE_COMMANDS, build_parser
from common.ipc import ROLE_SOCKETS, Addresses, bind_address
from common.options import resolve
from tests.conftest import ROOT, free_port, wait_ready, worker_env

COMPOSE = os.path.join(ROOT, "docker-compose.yml")


def load_compose() -> dict[str, Any]:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` / `${VAR}`, from `env`."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1), m.group(2) or ""), str(value))


def service_env(service: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    return {k: interpolate(v, env or {}) for k, v in (service.get("environment") or {}).items()}


def service_argv(service: dict[str, Any]) -> list[str]:
    argv = list(service.get("entrypoint") or []) + list(service.get("command") or [])
    assert argv[0] == "voxpipe", f"services run the voxpipe CLI, got {argv}"
    return argv[1:]


def role_settings(service: dict[str, Any]) -> tuple[str, Any]:
    argv = service_argv(service)
    args = build_parser().parse_args(argv)
    role = ROLE_COMMANDS[args.command]
    return role, resolve(role, args, service_env(service))


def test_every_compose_service_runs_a_real_command_of_the_cli():
    services = load_compose()["services"]
    assert {"gateway", "tokenizer", "gpu_worker", "codec_worker"} <= set(services)
    roles = set()
    for name, svc in services.items():
        argv = service_argv(svc)
        args = build_parser().parse_args(argv)  # exits (fails the test) on an unknown flag
        if "debug" in (svc.get("profiles") or []):
            assert args.command == "tap", name
            continue
        assert args.command in ROLE_COMMANDS, f"{name}: {argv} names no role"
        roles.add(ROLE_COMMANDS[args.command])
        resolve(ROLE_COMMANDS[args.command], args, service_env(svc))  # valid settings
    assert roles == set(ROLE_SOCKETS)


def test_every_connect_address_in_compose_has_a_service_binding_it():
    services = load_compose()["services"]
    bound: dict[tuple[str, str], str] = {}  # (service, port) → what it binds there
    plans = {}
    for name, svc in services.items():
        if svc.get("profiles"):
            continue
        role, s = role_settings(svc)
        plans[name] = (role, s)
        for field in ROLE_SOCKETS[role][0]:
            addr = getattr(s.cfg.addresses, field)
            assert bind_address(addr).startswith("tcp://*:"), f"{name} binds {addr} on every interface"
            bound[(name, addr.rpartition(":")[2])] = field
        if s.tap:
            bound[(name, s.tap.rpartition(":")[2])] = "tap"
    for name, (role, s) in plans.items():
        for field in ROLE_SOCKETS[role][1]:
            host, port = getattr(s.cfg.addresses, field).removeprefix("tcp://").rsplit(":", 1)
            assert bound.get((host, port)) == field, (
                f"{name} connects {field} to {host}:{port}: nobody binds it"
            )
    tap = build_parser().parse_args(service_argv(services["tap"]))
    for addr in tap.connect:
        host, port = addr.removeprefix("tcp://").rsplit(":", 1)
        assert bound.get((host, port)) == "tap", f"the tap service reads {addr}: no process taps there"


def test_gateway_has_a_ready_healthcheck_and_the_tokenizer_scales():
    services = load_compose()["services"]
    gw = services["gateway"]
    check = " ".join(gw["healthcheck"]["test"])
    _, s = role_settings(gw)
    assert f"127.0.0.1:{s.cfg.gateway.port}/ready" in check
    assert s.cfg.gateway.host == "0.0.0.0" and any(p.endswith(f":{s.cfg.gateway.port}") for p in gw["ports"])
    tok = services["tokenizer"]
    assert "container_name" not in tok and "ports" not in tok, "--scale tokenizer=N needs both absent"
    for name in ("gpu_worker", "codec_worker"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), name
    models = {service_env(svc)["VOXPIPE_MODEL"] for svc in services.values()}
    assert len(models) == 1, "every service serves the same model"


def test_the_image_installs_the_gpu_extra_without_weights_and_caches_in_a_volume():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    assert '".[gpu]"' in text
    assert re.search(r"HF_HOME=/cache", text) and 'VOLUME ["/cache"]' in text
    assert "huggingface-cli download" not in text and "snapshot_download" not in text
    volumes = load_compose()["services"]["gpu_worker"]["volumes"]
    assert any(v.endswith(":/cache") for v in volumes)


# --- the same topology as processes on this host ----------------------------------------------------


class Topology:
    """Compose's services as local processes: host names → localhost, ports → free ones."""

    def __init__(self, tokenizers: int = 2) -> None:
        self.services = {k: v for k, v in load_compose()["services"].items() if not v.get("profiles")}
        ports: dict[str, int] = {}

        def local(addr: str) -> str:
            host, port = addr.removeprefix("tcp://").rsplit(":", 1)
            ports.setdefault(f"{host}:{port}", free_port())
            return f"tcp://localhost:{ports[f'{host}:{port}']}"

        self.http_port = free_port()
        self.keys = tempfile.mkdtemp(prefix="vpkeys-")
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, dict[str, str]] = {}
        overrides = {"VOXPIPE_MODEL": "orpheus-tiny", "VOXPIPE_DEVICE": "cpu", "VOXPIPE_LOAD_FORMAT": "auto"}
        for name, svc in self.services.items():
            env = service_env(svc, overrides)
            for field in Addresses.__struct_fields__:
                key = f"VOXPIPE_{field.upper()}"
                if key in env:
                    env[key] = local(env[key])
            env["VOXPIPE_TAP"] = ""  # every process would bind 5570 on this one host
            env["VOXPIPE_ZMQ_CURVE_DIR"] = os.path.join(self.keys, "curve")  # the `keys` volume
            if name == "gateway":
                env["VOXPIPE_HOST"], env["VOXPIPE_PORT"] = "127.0.0.1", str(self.http_port)
            self.env[name] = env
        self.base = f"http://127.0.0.1:{self.http_port}"
        for name in self.services:
            for _ in range(tokenizers if name == "tokenizer" else 1):
                self.start(name)

    def start(self, name: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "common.cli", *service_argv(self.services[name])]
        proc = subprocess.Popen(argv, env={**worker_env(), **self.env[name]}, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.keys, ignore_errors=True)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology()
    try:
        yield topo
    finally:
        topo.stop()


def test_the_compose_topology_serves_a_wav_over_tcp_on_one_host(topology):
    gateway = topology.procs[0]
    ready = wait_ready(topology.base, gateway, timeout=120)
    deadline = time.monotonic() + 30
    while sum(p["role"] == "tokenizer_worker" for p in ready["processes"]) < 2:
        assert time.monotonic() < deadline, ready  # the second replica joins under its own name
        time.sleep(0.2)
        ready = wait_ready(topology.base, gateway)
    req = urllib.request.Request(
        topology.base + "/generate",
        data=b'{"text": "Over tcp.", "seed": 3, "max_tokens": 90, "streaming": false}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        wav = r.read()
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and len(audio) > 0


def test_the_cpu_variant_reserves_no_gpu_and_serves_on_the_cpu():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: {"!reset": loader.construct_mapping(node)})
    with open(os.path.join(ROOT, "docker-compose.cpu.yml")) as f:
        cpu = yaml.load(f, Loader=Loader)["services"]
    base = load_compose()["services"]
    assert set(cpu) == {name for name, svc in base.items() if not svc.get("profiles")}
    for name in ("gpu_worker", "codec_worker"):
        assert "deploy" in base[name] and cpu[name]["deploy"] == {"!reset": {}}, name  # no GPU reserved
    for name, svc in cpu.items():
        env = {**base[name].get("environment", {}), **svc["environment"]}
        assert (
            interpolate(env["VOXPIPE_DEVICE"], {}) == "cpu"
            and interpolate(env["VOXPIPE_MODEL"], {}) == "orpheus-tiny"
        )
