"""The `voxpipe` command line.

voxpipe serve          every process on this host over ipc:// (the embedded default)
voxpipe gateway        one process as a service, over tcp:// (also `python -m gateway`);
voxpipe tokenizer      likewise `tokenizer_worker`, `gpu_worker`, `codec_worker`
voxpipe gpu-worker
voxpipe codec-worker
voxpipe tap            print per-request timelines from the processes' taps
voxpipe models         the model names --model accepts
voxpipe keys DIR       CURVE keypairs for tcp:// between hosts (then --zmq-curve-dir DIR everywhere)
"""

from __future__ import annotations

import argparse
import logging
import sys

from common.config import ServeConfig, check_model_settings
from common.options import add_options, as_flags, resolve
from common.proc import setup_logging

# `voxpipe <command>` → the role (= package) it runs
ROLE_COMMANDS = {
    "gateway": "gateway",
    "tokenizer": "tokenizer_worker",
    "gpu-worker": "gpu_worker",
    "codec-worker": "codec_worker",
}


def _validate(cfg: ServeConfig) -> None:
    from programs import get_spec, served_name

    cfg.model = served_name(cfg.model)  # "" → the registry's default, named for every process
    check_model_settings(cfg, get_spec(cfg.model))  # get_spec raises with the list of models
    cfg.check()
    if cfg.zmq_curve_dir:
        from common.ipc import CurveKeys, ensure_curve_keys

        ensure_curve_keys(cfg.zmq_curve_dir)  # a directory that does not exist gets fresh keys
        CurveKeys(cfg.zmq_curve_dir)  # a directory without them fails here, naming `voxpipe keys`
    if cfg.gateway.api_key_file:
        from gateway.auth import load_api_key

        load_api_key(cfg)  # an unreadable or empty key file fails here, not in the gateway


def build_parser() -> argparse.ArgumentParser:
    from common import __version__

    parser = argparse.ArgumentParser(prog="voxpipe", description="Serve speech language models.")
    parser.add_argument("--version", action="version", version=f"voxpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_options(sub.add_parser("serve", help="start every process on this host and serve HTTP"), "serve")
    for command, role in ROLE_COMMANDS.items():
        add_options(sub.add_parser(command, help=f"run the {role} as a service (tcp:// addresses)"), role)
    from common.tap import add_tap_args

    add_tap_args(sub.add_parser("tap", help="print request timelines (JSON lines) from the processes' taps"))
    sub.add_parser(
        "models", help="list the model names --model accepts, with the settings each chooses for itself"
    )
    keys = sub.add_parser(
        "keys",
        help="create CURVE keys that encrypt and authenticate tcp:// sockets (use with --zmq-curve-dir)",
    )
    keys.add_argument("dir", help="directory for the keys (created mode 0700; existing keys are kept)")
    bench = sub.add_parser(
        "bench",
        help="benchmarks: load curve (default), step, ttfa, offline, codec…; see --help",
        add_help=False,
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `voxpipe <command>`, whose usage a flag error of that command prints."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.cli import main as run_bench

        sys.exit(run_bench(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "models":
        from common.options import model_defaults
        from programs import DEFAULT_MODEL, model_names

        for n in model_names():
            own = as_flags(model_defaults(n))
            print(
                n + (" (default)" if n == DEFAULT_MODEL else "") + (f"  [serves with {own}]" if own else "")
            )
        return
    if args.command == "keys":
        from common.ipc import create_curve_keys

        written = create_curve_keys(args.dir)
        print("\n".join(written) if written else f"{args.dir} already holds every key")
        print(
            f"every process: --zmq-curve-dir {args.dir} (VOXPIPE_ZMQ_CURVE_DIR); copy the directory to "
            "each host, readable only by the service user",
            file=sys.stderr,
        )
        return
    if args.command == "tap":
        from common.tap import run_tap

        try:
            sys.exit(run_tap(args))
        except ValueError as e:
            parser.error(str(e))
    role = "serve" if args.command == "serve" else ROLE_COMMANDS[args.command]
    try:
        settings = resolve(role, args)
        if role == "serve":
            _validate(settings.cfg)
    except ValueError as e:
        _subparser(parser, args.command).error(str(e))  # the command's own usage, not voxpipe's
    if role == "serve":
        setup_logging("serve", settings.cfg.log_level)
        if settings.chosen:
            logging.getLogger("voxpipe").info(
                "%s serves with settings of its own: %s (a flag or VOXPIPE_* variable overrides each)",
                settings.cfg.model,
                as_flags(settings.chosen),
            )
        from common.launcher import serve

        sys.exit(serve(settings.cfg))
    # Each package's __main__ is the one place that runs its process; import it only now (torch).
    if role == "gateway":
        from gateway.__main__ import main as run_gateway

        sys.exit(run_gateway(settings=settings))
    module = __import__(f"{role}.__main__", fromlist=["main"])
    module.main(settings=settings)


if __name__ == "__main__":
    main()
