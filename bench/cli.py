"""`voxpipe bench`: the benchmark suite, one sub-command per measurement (bench/README.md).

    voxpipe bench [load] --url URL --concurrency 1,8,32     load curve of a running server
    voxpipe bench ttfa -- --max-batch-size 512              starts a server: single-stream TTFA (+ --load)
    voxpipe bench step | offline | speed                    GPU engine: step, offline, the whole report
    voxpipe bench codec | codec-profile                     GPU codec: windows per second, where time goes
    voxpipe bench codec-streams --model qwen3-tts          GPU codec streams: a pass by entries and frames
    voxpipe bench ws --sessions 1,100 --word-ms 10,30       WebSocket input streaming of a running server
    voxpipe bench connect --clients 384                     a burst of connections to a running server
    voxpipe bench gateway --clients 400                     the gateway's CPU per request and per audio second

`voxpipe bench --url …` (no sub-command) is `voxpipe bench load --url …`. Every sub-command takes
`--help`. Each module's `main(argv)` parses the arguments after the sub-command; a preset's own
arguments come first, so the ones given on the command line override them.
"""

from __future__ import annotations

import importlib
import sys

# name: (module, preset arguments, what it measures)
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "load": ("bench.load_cli", [], "load curve of a running server over HTTP (closed loop or Poisson)"),
    "ttfa": (
        "bench.ttfa_http",
        [],
        "start `voxpipe serve` (dummy weights): TTFA at the client, + --load curve",
    ),
    "step": ("bench.gpu_speed", ["--skip", "ttfa,offline,baseline"], "GPU: decode and prefill step times"),
    "offline": (
        "bench.gpu_speed",
        ["--skip", "steps,prefill,ttfa,baseline"],
        "GPU: offline throughput (x real time) of the engine and codec in one process",
    ),
    "speed": ("bench.gpu_speed", [], "GPU: step, prefill, in-process TTFA, offline and the HF baseline"),
    "profile": ("bench.profile_step", [], "GPU: where one engine step's time goes (torch.profiler)"),
    "options": ("bench.lm_options", [], "GPU: step time and logits per LM option (head, fp8, KV dtype, XQA)"),
    "attention": ("bench.attention_kv", [], "GPU: paged decode attention alone, per kernel and KV dtype"),
    "op-invariance": ("bench.op_invariance", [], "which op makes a row depend on its batch (first size)"),
    "codec": ("bench.codec_speed", [], "GPU: SNAC window decodes per batch size, per variant"),
    "codec-profile": ("bench.codec_profile", [], "GPU: where a SNAC window's time goes, compiled variants"),
    "codec-streams": (
        "bench.codec_streams",
        [],
        "GPU: a codec-stream model's decode pass by entries and frames, graphed and compiled",
    ),
    "ws": (
        "bench.websocket",
        [],
        "input streaming over the WebSocket: words appended at a set pace, N sessions (a running server)",
    ),
    "connect": (
        "bench.connect_burst",
        [],
        "N clients connecting at once to a running server: each one's wait for /health (the accept queue)",
    ),
    "gateway": (
        "bench.gateway_cost",
        [],
        "the gateway's CPU time per request and per second of audio, bursts against a server on this host",
    ),
    "sim": ("bench.admission_sim", [], "admission and sit-out policies on a simulated GPU"),
    "tap-stats": ("bench.tap_stats", [], "where a request's time goes, from `voxpipe tap` output"),
}


def usage() -> str:
    lines = ["usage: voxpipe bench [COMMAND] [ARGS...]   (COMMAND --help for its arguments)", ""]
    lines += [f"  {name:<14} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Without a COMMAND the arguments go to `load`: voxpipe bench --url URL --concurrency 1,8"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    name, rest = (argv[0], argv[1:]) if argv[:1] and argv[0] in COMMANDS else ("load", argv)
    if name == "load" and argv[:1] and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"voxpipe bench: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, preset, _ = COMMANDS[name]
    sys.argv[0] = f"voxpipe bench {name}"
    return importlib.import_module(module).main([*preset, *rest]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
