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
import sys

from common.config import (
    ServeConfig,
    add_options,
    check_codec_settings,
    check_headroom,
    check_model_settings,
    check_sit_out,
    resolve,
)
from common.proc import setup_logging

# `voxpipe <command>` → the role (= package) it runs
ROLE_COMMANDS = {
    "gateway": "gateway",
    "tokenizer": "tokenizer_worker",
    "gpu-worker": "gpu_worker",
    "codec-worker": "codec_worker",
}


MAX_TEXT_CHARS = 50_000  # the gateway's own cap (gateway/segments.py MAX_TEXT_CHARS_LIMIT)


def _validate(cfg: ServeConfig) -> None:
    from programs import get_spec, served_name

    cfg.model = served_name(cfg.model)  # "" → the registry's default, named for every process
    check_model_settings(cfg, get_spec(cfg.model))  # get_spec raises with the list of models
    if cfg.tokenizer_workers < 1:
        raise ValueError("--tokenizer-workers must be at least 1")
    if cfg.gpu_workers < 1:
        raise ValueError("--gpu-workers must be at least 1")
    for spec in (cfg.device, cfg.codec_device):
        n = len([p for p in spec.split(",") if p.strip()])
        if n > 1 and n != cfg.gpu_workers:
            raise ValueError(
                f"--device/--codec-device list {n} devices but --gpu-workers is {cfg.gpu_workers}"
            )
    if not 1 <= cfg.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {cfg.port}")
    if cfg.page_size < 1 or cfg.max_batch_size < 0 or cfg.max_context < 0 or cfg.num_pages < 0:
        raise ValueError("--page-size must be positive; --max-batch-size, --max-context, --num-pages >= 0")
    check_codec_settings(cfg)
    if cfg.codec_gpu_share and cfg.mps == "off":
        raise ValueError("--codec-gpu-share caps the codec's SMs under MPS: it needs --mps on or auto")
    check_headroom(cfg.realtime_headroom)
    check_headroom(cfg.capacity_headroom, "--capacity-headroom")
    check_sit_out(cfg.sit_out)
    if cfg.max_queue < 0 or cfg.max_streams < 0 or not 0 < cfg.queue_timeout < float("inf"):
        raise ValueError("--max-queue and --max-streams must be >= 0 and --queue-timeout a positive number")
    if cfg.zmq_curve_dir:
        from common.ipc import CurveKeys

        CurveKeys(cfg.zmq_curve_dir)  # missing keys fail here, naming `voxpipe keys`
    if cfg.api_key_file:
        from gateway.auth import load_api_key

        load_api_key(cfg)  # an unreadable or empty key file fails here, not in the gateway
    if not 1 <= cfg.max_text_chars <= MAX_TEXT_CHARS:
        raise ValueError(f"--max-text-chars must be in 1..{MAX_TEXT_CHARS}, got {cfg.max_text_chars}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxpipe", description="Serve speech language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_options(sub.add_parser("serve", help="start every process on this host and serve HTTP"), "serve")
    for command, role in ROLE_COMMANDS.items():
        add_options(sub.add_parser(command, help=f"run the {role} as a service (tcp:// addresses)"), role)
    from common.tap import add_tap_args

    add_tap_args(sub.add_parser("tap", help="print request timelines (JSON lines) from the processes' taps"))
    sub.add_parser("models", help="list the model names --model accepts")
    keys = sub.add_parser(
        "keys",
        help="create CURVE keys that encrypt and authenticate tcp:// sockets (use with --zmq-curve-dir)",
    )
    keys.add_argument("dir", help="directory for the keys (created mode 0700; existing keys are kept)")
    bench = sub.add_parser(
        "bench",
        help="load a running server over HTTP (TTFA, on-time share, x real time); see --help",
        add_help=False,
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.load import main as run_bench

        sys.exit(run_bench(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "models":
        from programs import DEFAULT_MODEL, model_names

        print("\n".join(f"{n} (default)" if n == DEFAULT_MODEL else n for n in model_names()))
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
        parser.error(str(e))
    if role == "serve":
        setup_logging("serve", settings.cfg.log_level)
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
