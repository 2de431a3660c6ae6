"""`python -m gateway --config-json '<ServeConfig JSON>'`: run the HTTP gateway until SIGINT/SIGTERM.

`voxpipe serve` starts it with the same config JSON as every other process; exiting non-zero tells
the supervisor that it failed.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys

from aiohttp import web

from common.config import ServeConfig

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--config-json", required=True, help="the deployment's ServeConfig as JSON")
    parser.add_argument("--name", default="gateway", help="process name in logs (the launcher passes it)")
    args = parser.parse_args(argv)
    # Named so that log lines from every process of a deployment say which one wrote them.
    multiprocessing.current_process().name = args.name
    try:
        cfg = ServeConfig.from_json(args.config_json)
        logging.basicConfig(
            level=cfg.log_level.upper(),
            format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s",
        )
        from gateway.server import build_app  # after logging is set up: imports may log

        app = build_app(cfg)
        log.info("listening on http://%s:%d", cfg.host, cfg.port)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request on the gpu_worker at once instead of after the next chunk.
        web.run_app(app, host=cfg.host, port=cfg.port, handler_cancellation=True, print=None)
    except Exception:
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(message)s")
        log.exception("gateway failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
