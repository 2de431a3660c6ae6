"""The `voxpipe` command line."""

from __future__ import annotations

import argparse
import sys

from common.config import ServeConfig
from common.proc import setup_logging


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--model", default=d.model, help="model name (see `voxpipe models`)")
    p.add_argument("--host", default=d.host, help="HTTP bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--tokenizer-workers", type=int, default=d.tokenizer_workers, help="prompt-builder processes"
    )
    p.add_argument("--device", default=d.device, help="LM device: auto, cpu, cuda, cuda:N")
    p.add_argument("--codec-device", default=d.codec_device, help="codec device (default: the LM's)")
    p.add_argument(
        "--load-format", choices=["auto", "dummy"], default=d.load_format, help="dummy = random weights"
    )
    p.add_argument("--weights", default="", help="LM checkpoint: Hugging Face id or local directory")
    p.add_argument("--codec-weights", default="", help="codec checkpoint: Hugging Face id or local directory")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run GPU steps eagerly (debugging)")
    p.add_argument("--dtype", default=d.dtype, help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="0 = 256 on GPU, 16 on CPU")
    p.add_argument("--max-context", type=int, default=d.max_context, help="0 = the model's max_tokens")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, default=d.num_pages, help="0 = max-batch-size full contexts")
    p.add_argument(
        "--constrained",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep sampled tokens valid codes for their frame position (default: the model's choice)",
    )
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars, help="longest accepted text")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--run-dir", default="", help="directory for ipc:// sockets (default: a private temp dir)")


def _config_from_args(args: argparse.Namespace) -> ServeConfig:
    fields = {f: getattr(args, f) for f in ServeConfig.__struct_fields__ if hasattr(args, f)}
    return ServeConfig(**fields)


def _validate(cfg: ServeConfig) -> None:
    from programs import get_spec

    get_spec(cfg.model)  # raises with the list of models
    if cfg.tokenizer_workers < 1:
        raise ValueError("--tokenizer-workers must be at least 1")
    if not 1 <= cfg.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {cfg.port}")
    if cfg.page_size < 1 or cfg.max_batch_size < 0 or cfg.max_context < 0 or cfg.num_pages < 0:
        raise ValueError("--page-size must be positive; --max-batch-size, --max-context, --num-pages >= 0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="voxpipe", description="Serve speech language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_args(sub.add_parser("serve", help="start every process on this host and serve HTTP"))
    sub.add_parser("models", help="list the model names --model accepts")
    args = parser.parse_args(argv)

    if args.command == "models":
        from programs import model_names

        print("\n".join(model_names()))
        return
    if args.command == "serve":
        cfg = _config_from_args(args)
        setup_logging("serve", cfg.log_level)
        try:
            _validate(cfg)
        except ValueError as e:
            parser.error(str(e))
        from common.launcher import serve

        sys.exit(serve(cfg))


if __name__ == "__main__":
    main()
