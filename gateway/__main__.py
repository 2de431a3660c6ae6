"""`python -m gateway` (or `voxpipe gateway`): run the HTTP gateway until SIGINT/SIGTERM.

Settings from flags or VOXPIPE_* variables (`--help` lists them), or `--config-json` from
`voxpipe serve`, which starts it with the same config as every other process; exiting non-zero
tells the supervisor that it failed.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys

from aiohttp import web

from common.ipc import install_tap, use_curve
from common.options import RoleSettings, parse_role
from common.proc import freeze_startup_objects, setup_logging, use_uvloop
from common.threads import apply_threads

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None, settings: RoleSettings | None = None) -> int:
    settings = settings or parse_role("gateway", argv)
    cfg = settings.cfg
    # Named so that log lines from every process of a deployment say which one wrote them.
    multiprocessing.current_process().name = settings.name
    try:
        setup_logging(settings.name, cfg.log_level)  # the format every process logs in
        apply_threads("gateway", cfg)  # its imports never load torch: the variables, for any library
        if settings.tap:
            install_tap(settings.tap, settings.name)
        if cfg.zmq_curve_dir:
            use_curve(cfg.zmq_curve_dir)
        log.info("event loop: %s", "uvloop" if use_uvloop() else "asyncio")
        from gateway.server import build_app  # after logging is set up: imports may log

        app = build_app(cfg)
        freeze_startup_objects()
        log.info("listening on http://%s:%d", cfg.gateway.host, cfg.gateway.port)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request on the gpu_worker at once instead of after the next chunk.
        web.run_app(app, host=cfg.gateway.host, port=cfg.gateway.port, handler_cancellation=True, print=None)
    except Exception:
        if not logging.getLogger().handlers:
            setup_logging(settings.name)
        log.exception("gateway failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
