"""What every worker process shares: logging, status reporting with heartbeats, and `run_worker`,
the body of each package's `__main__.main()` (name the process, log, build, report ready, loop; on
an exception log it, report FAILED, exit non-zero).

A worker with a `stop()` method (the tokenizer worker) stops gracefully on SIGTERM/SIGINT: `stop()`
asks its loop to finish, and `run()` returns once it has handed back or finished its work."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from common.config import ServeConfig
from common.ipc import ROLE_SOCKETS, PushChannel, install_tap, secure_sockets
from common.messages import ProcState, ProcStatus
from common.options import RoleSettings, parse_role
from common.threads import apply_threads

HEARTBEAT_S = 0.25
REFUSED = 2  # the exit status of a process that cannot start for a reason a restart cannot mend

log = logging.getLogger(__name__)


def _read_host_id() -> str:
    """This host's boot and PID namespace ("" where there is no /proc): two processes with the same
    one see each other's pids, so the gateway can tell a worker that exited from one that is slow."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


HOST_ID = _read_host_id()
_HAS_PROC = os.path.isdir("/proc/self")


def process_start(pid: int) -> str | None:
    """An opaque mark of process `pid`'s start (its start time in clock ticks), "" where there is no
    /proc to read it from; None when no such process runs (gone, or exited and not yet reaped). A
    pid reused by another process gives another mark."""
    if pid <= 0:
        return None
    if not _HAS_PROC:
        return _kill_check(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _kill_check(pid)
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def _kill_check(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s.%(msecs)03d {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


class StatusReporter:
    """Sends ProcStatus to the gateway on every change and as a heartbeat from its own thread
    (with its own socket: zmq sockets are not thread-safe), so a worker busy loading weights or
    running a long step still counts as alive, and a dead one goes quiet."""

    def __init__(self, addr: str, name: str, role: str) -> None:
        self._addr = addr
        self._name = name
        self._role = role
        self._state = ProcState.STARTING
        self._detail = ""
        self._load = 0
        self._capacity = 0
        self._metrics: dict[str, float] = {}
        self._unfit: set[str] = set()  # metrics that were no number, said once
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._name

    def set(self, state: ProcState, detail: str = "") -> None:
        self._state, self._detail = state, detail
        self._wake.set()

    def set_load(self, load: int, capacity: int = 0, metrics: dict[str, float] | None = None) -> None:
        """Called from the worker's loop; the heartbeat thread sends the latest values."""
        self._load, self._capacity = load, capacity
        if metrics is not None:
            # Python floats: msgspec encodes no numpy scalar, and a status that does not encode
            # would leave the gateway without this worker's heartbeat. A value that is no number
            # is left out (and said once), never an error in the worker's loop.
            clean: dict[str, float] = {}
            for k, v in metrics.items():
                try:
                    clean[k] = float(v)
                except (TypeError, ValueError):
                    if k not in self._unfit:
                        self._unfit.add(k)
                        log.error("metric %s is not a number (%r): left out of the heartbeat", k, v)
            self._metrics = clean

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        # Its own socket (zmq sockets are single-thread), never mirrored on the tap: heartbeats
        # are noise on a per-request timeline.
        chan: PushChannel[ProcStatus] = PushChannel(self._addr, tap=False)
        while True:
            stopping = self._stop.is_set()  # read first: the last state set before close() goes out
            status = ProcStatus(
                name=self._name,
                role=self._role,
                pid=os.getpid(),
                state=self._state,
                detail=self._detail,
                time=time.time(),
                load=self._load,
                capacity=self._capacity,
                metrics=dict(self._metrics),
                host=HOST_ID,
            )
            try:
                chan.send(status)
            except Exception:  # a status that does not encode: the heartbeat goes on without metrics
                log.exception("could not send the status with its metrics; sending it without them")
                status.metrics = {}
                try:
                    chan.send(status)
                except Exception:
                    log.exception("could not send the status")
            if stopping:
                break
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
        time.sleep(0.05)  # LINGER is 0: give the last status a moment to leave
        chan.close()


SOMAXCONN = "/proc/sys/net/core/somaxconn"


def kernel_backlog_cap(path: str = SOMAXCONN) -> int | None:
    """The most connections the kernel queues on a listening socket (Linux's net.core.somaxconn),
    or None where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def raise_open_files(want: int) -> tuple[int, int]:
    """Raise this process's soft limit on open files to `want`, within its hard limit (a process may
    do so itself); never lower it. Returns the (soft, hard) limits now, -1 for unlimited, or (-1, -1)
    where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    inf = resource.RLIM_INFINITY
    return (-1 if soft == inf else soft), (-1 if hard == inf else hard)


def use_uvloop() -> bool:
    """Run asyncio on uvloop where it is installed (a dependency on Linux and macOS): the gateway's
    one event loop writes every stream's chunks and takes every request, and uvloop's callbacks and
    socket writes cost a fraction of the default loop's. Returns whether it is in use."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def freeze_startup_objects() -> None:
    """What startup built (models, graphs, tables, imported modules) lives as long as the process:
    move it out of the cyclic collector's reach. A full collection over it took ~78 ms with the
    tiny model's engine loaded (173k objects, 2-core CPU), a pause in the serving loop; after
    `gc.freeze()`, 0 ms."""
    gc.collect()
    gc.freeze()


# Errors a restart cannot mend, by the exception's class name (no import of the libraries raising
# them): weights the hub cannot give (not cached and unreachable, missing, gated) ...
_WEIGHT_ERRORS = (
    "LocalEntryNotFoundError", "EntryNotFoundError", "RepositoryNotFoundError", "RevisionNotFoundError",
    "GatedRepoError", "OfflineModeIsEnabled",
)  # fmt: skip
# ... and a CUDA device that this torch or this host cannot give.
_NO_CUDA = ("Torch not compiled with CUDA enabled", "No CUDA GPUs are available", "Found no NVIDIA driver")


def refusal(e: BaseException, cfg: ServeConfig) -> str:
    """One line saying why this process cannot start and what to change, when `e` (or an error it
    came from) is one a restart cannot mend; "" otherwise."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {cls.__name__ for cls in type(err).__mro__}
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        hub = isinstance(err, (FileNotFoundError, ConnectionError)) and "Hugging Face" in str(err)
        if names & set(_WEIGHT_ERRORS) or hub:
            return (
                f"cannot load the weights of {cfg.model or 'the model'} ({type(err).__name__}: {first}); "
                "download them while online (they are cached), give a local directory with --weights "
                "/ --codec-weights, or use --load-format dummy"
            )
        if any(text in str(err) for text in _NO_CUDA):
            return (
                f"--device {cfg.device} / --codec-device {cfg.codec.device} asks for CUDA, but {first}; "
                "install a CUDA build of torch, or use --device cpu"
            )
        err = err.__cause__ or err.__context__
    return ""


def secure(role: str, cfg: ServeConfig, tap: str = "") -> str:
    """Set up CURVE for this process's sockets, its tap's among them (`common.ipc.secure_sockets`),
    before it makes any; "" when done, else one line saying why it cannot start and what to set."""
    assert cfg.addresses is not None, "config has no addresses"
    binds, connects = ROLE_SOCKETS[role]
    addrs = [getattr(cfg.addresses, f) for f in (*binds, *connects)] + ([tap] if tap else [])
    try:
        secure_sockets(cfg.zmq_curve_dir, addrs, cfg.zmq_insecure)
    except (ValueError, OSError) as e:
        return str(e)
    return ""


def run_worker(
    role: str,
    build: Callable[[ServeConfig, StatusReporter], Any],
    argv: list[str] | None = None,
    settings: RoleSettings | None = None,
) -> None:
    """Build the worker (which reports LOADING progress itself), report READY, run its loop."""
    settings = settings or parse_role(role, argv)
    cfg, name = settings.cfg, settings.name
    setup_logging(name, cfg.log_level)
    log.debug("%s computes with %d CPU threads", name, apply_threads(role, cfg))
    assert cfg.addresses is not None, "config has no addresses"
    why = secure(role, cfg, settings.tap)  # before any socket: the tap's and the heartbeat's too
    if why:
        log.error("%s cannot start: %s", name, why)
        sys.exit(REFUSED)
    if settings.tap:
        install_tap(settings.tap, name)
    status = StatusReporter(cfg.addresses.gateway_in, name, role)
    try:
        status.set(ProcState.LOADING, "starting")
        worker = build(cfg, status)
        stop = getattr(worker, "stop", None)
        if stop is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda _signum, _frame: stop())
        freeze_startup_objects()
        status.set(ProcState.READY)
        log.info("%s ready", name)
        worker.run()
        status.set(ProcState.STOPPING)
        log.info("%s stopped", name)
    except KeyboardInterrupt:
        status.set(ProcState.STOPPING)
    except Exception as e:
        why = refusal(e, cfg)
        if why:  # one line, and a status that tells the supervisor a restart would not help
            log.error("%s cannot start: %s", name, why)
        else:
            log.exception("%s failed", name)
        status.set(ProcState.FAILED, why or f"{type(e).__name__}: {e}")
        time.sleep(2 * HEARTBEAT_S)  # let the FAILED status reach the gateway
        status.close()
        sys.exit(REFUSED if why else 1)
    status.close()
