"""`python -m gateway` (or `voxpipe gateway`): run the HTTP gateway until SIGINT/SIGTERM.

Settings from flags or VOXPIPE_* variables (`--help` lists them), or `--config-json` from
`voxpipe serve`, which starts it with the same config as every other process; exiting non-zero
tells the supervisor that it failed.
"""

from __future__ import annotations

import errno
import gc
import logging
import multiprocessing
import sys

from aiohttp import web
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from common.config import ServeConfig
from common.ipc import install_tap
from common.options import RoleSettings, parse_role
from common.proc import (
    REFUSED,
    freeze_startup_objects,
    kernel_backlog_cap,
    raise_open_files,
    secure,
    setup_logging,
    use_uvloop,
)
from common.threads import apply_threads

log = logging.getLogger("gateway")
LAUNCHER_AGENT = "voxpipe-serve"  # the User-Agent of `voxpipe serve`'s own /ready polls


def check_backlog(backlog: int, cap: int | None) -> None:
    """Warn where the kernel holds the gateway's `--listen-backlog` to less (`cap`): a burst of
    connects beyond the kernel's queue waits for the clients' SYN retries (~1 s each)."""
    if cap is not None and cap < backlog:
        log.warning(
            "the kernel queues at most %d connections to accept (net.core.somaxconn), not the %d of "
            "--listen-backlog: clients connecting at once beyond it wait ~1 s each; raise it with "
            "`sysctl -w net.core.somaxconn=%d` (a container: its `sysctls`)",
            cap,
            backlog,
            backlog,
        )


# The gateway's open-file limit is raised to this (within the hard limit): a descriptor per client
# connection, streaming or queued, beside its sockets and files.
OPEN_FILES = 65536
# The cyclic collector's first-generation threshold in the gateway (CPython's default: 700). A
# request in flight holds a few hundred tracked objects (aiohttp's request and response, the
# handler's coroutines and futures) that reference counting frees when it ends, so at 700 a burst's
# intake runs a collection every few requests that finds no garbage: 35-65 us a request, and pauses
# of 2-6 ms when it reaches the older generations (a 2-core CPU host).
GC_THRESHOLD_0 = 50_000


def files_needed(cfg: ServeConfig) -> int:
    """Descriptors the gateway may hold at once: a connection for each request waiting in the queue
    (`--max-queue`) and each stream (`--max-streams`, else the gpu_workers' batches: the most they
    admit), and a margin for its own sockets and files."""
    streams = cfg.gateway.max_streams or (cfg.gpu.max_batch_size or 512) * cfg.gpu_workers
    return cfg.gateway.max_queue + streams + 256


def check_open_files(need: int, soft: int) -> None:
    """Warn where the open-file limit (`soft`, -1: none) is below what the gateway may hold (`need`):
    past it, a client's connection is closed unanswered."""
    if 0 <= soft < need:
        log.warning(
            "the gateway may hold %d connections (--max-queue and the streams) but may open only %d "
            "files (the hard limit, `ulimit -Hn`): clients beyond it are cut off unanswered; raise "
            "the hard limit (a container: its `ulimits`) or lower --max-queue",
            need,
            soft,
        )


class AccessLog(AccessLogger):
    """aiohttp's access log, but `voxpipe serve`'s own /ready polls (five a second while the
    processes start) go at DEBUG: the log shows what clients asked."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if request.headers.get("User-Agent", "") == LAUNCHER_AGENT:
            if self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug("%s %s %d (voxpipe serve)", request.method, request.path, response.status)
            return
        super().log(request, response, time)


def main(argv: list[str] | None = None, settings: RoleSettings | None = None) -> int:
    settings = settings or parse_role("gateway", argv)
    cfg = settings.cfg
    # Named so that log lines from every process of a deployment say which one wrote them.
    multiprocessing.current_process().name = settings.name
    try:
        setup_logging(settings.name, cfg.log_level)  # the format every process logs in
        apply_threads("gateway", cfg)  # its imports never load torch: the variables, for any library
        why = secure("gateway", cfg, settings.tap)  # before any socket, the tap's too
        if why:
            log.error("%s cannot start: %s", settings.name, why)
            return REFUSED
        if settings.tap:
            install_tap(settings.tap, settings.name)
        log.info("event loop: %s", "uvloop" if use_uvloop() else "asyncio")
        from gateway.server import build_app  # after logging is set up: imports may log

        app = build_app(cfg)
        freeze_startup_objects()
        gc.set_threshold(GC_THRESHOLD_0, *gc.get_threshold()[1:])
        url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
        check_backlog(cfg.gateway.listen_backlog, kernel_backlog_cap())
        check_open_files(files_needed(cfg), raise_open_files(OPEN_FILES)[0])
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request on the gpu_worker at once instead of after the next chunk. `print` is called
        # once the socket listens. `backlog`: a burst of clients connects at once (GatewaySettings).
        web.run_app(
            app,
            host=cfg.gateway.host,
            port=cfg.gateway.port,
            backlog=cfg.gateway.listen_backlog,
            handler_cancellation=True,
            print=lambda _banner: log.info("listening on %s", url),
            access_log_class=AccessLog,
        )
    except Exception as e:
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            port = cfg.gateway.port
            log.error("cannot listen on %s:%d: %s; choose another --port", cfg.gateway.host, port, e.strerror)
            return REFUSED  # a restart cannot free the port: the supervisor stops
        if not logging.getLogger().handlers:
            setup_logging(settings.name)
        log.exception("gateway failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
