"""How each process gets its settings: flags and `VOXPIPE_*` variables → a `ServeConfig`.

Run as separate services (`python -m gpu_worker`, `voxpipe gpu-worker`), a process reads its
settings from flags or `VOXPIPE_*` environment variables (flags win over the environment; with
`--config-json` the environment is ignored, since the JSON is the whole deployment's config). One
table, `OPTIONS`, says which setting each role takes, its flag, its variable and the field of
`ServeConfig` (common/config.py) it sets.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from common.config import ServeConfig
from common.ipc import ROLE_SOCKETS, Addresses, is_wildcard

SERVICES = ("gateway", "tokenizer_worker", "gpu_worker", "codec_worker")
_ALL = ("serve", *SERVICES)
_LOADERS = ("serve", "tokenizer_worker", "gpu_worker", "codec_worker")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool | None:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    if t in ("", "auto", "default"):
        return None
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)} or auto")


@dataclass(frozen=True)
class Option:
    field: str  # the flag's name: ServeConfig setting, Addresses field, or per-process (name, tap)
    help: str
    roles: tuple[str, ...]
    type: Callable[[str], Any] = str
    kind: str = "config"  # config | address | process
    choices: tuple[str, ...] = ()
    negatable: bool = True  # a boolean flag with a --no- form (else: store_true)
    # config: where in ServeConfig the value goes ("gpu.page_size"; several, space-separated;
    # "" = the field of that name at the top level)
    path: str = ""
    invert: bool = False  # a boolean flag that sets its fields to the opposite (--disable-...)

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "VOXPIPE_" + self.field.upper()

    @property
    def paths(self) -> list[str]:
        return (self.path or self.field).split()

    def default(self, cfg: ServeConfig) -> Any:
        value = getattr(*_holder(cfg, self.paths[0]))
        return (not value) if self.invert else value

    def apply(self, cfg: ServeConfig, value: Any) -> None:
        for path in self.paths:
            setattr(*_holder(cfg, path), (not value) if self.invert else value)


def _holder(cfg: ServeConfig, path: str) -> tuple[Any, str]:
    """The struct that holds `path` ("gpu.page_size": cfg.gpu) and the field's name in it."""
    *groups, name = path.split(".")
    obj: Any = cfg
    for group in groups:
        obj = getattr(obj, group)
    return obj, name


def _address_roles(field: str) -> tuple[str, ...]:
    return tuple(r for r, (binds, connects) in ROLE_SOCKETS.items() if field in binds + connects)


OPTIONS: tuple[Option, ...] = (
    Option("model", "model name (see `voxpipe models`; default: the one it marks)", _ALL),
    Option(
        "host",
        "HTTP bind address (127.0.0.1: this host only; 0.0.0.0 in a container)",
        ("serve", "gateway"),
        path="gateway.host",
    ),
    Option("port", "HTTP port", ("serve", "gateway"), int, path="gateway.port"),
    Option(
        "listen_backlog",
        "HTTP connections the kernel queues for the gateway to accept (at most net.core.somaxconn); "
        "clients connecting at once beyond it wait ~1 s each",
        ("serve", "gateway"),
        int,
        path="gateway.listen_backlog",
    ),
    Option(
        "tokenizer_workers",
        "serve: prompt-builder processes to start; gateway: how many must be ready for /ready",
        ("serve", "gateway"),
        int,
        path="tokenizer.workers",
    ),
    Option(
        "gpu_workers",
        "serve: gpu_worker + codec_worker pairs to start (one per GPU); gateway: how many of each "
        "must be ready for /ready",
        ("serve", "gateway"),
        int,
    ),
    Option(
        "device",
        "LM device: auto, cpu, cuda, cuda:N (serve with --gpu-workers N: one, or a comma-separated "
        "list of N; auto/cuda give pair i cuda:i)",
        ("serve", "gpu_worker", "codec_worker"),
    ),
    Option(
        "codec_device",
        "codec device (auto: the LM's); with --gpu-workers a list too",
        ("serve", "codec_worker"),
        path="codec.device",
    ),
    Option("load_format", "auto (real weights) or dummy (random)", _LOADERS, choices=("auto", "dummy")),
    Option("weights", "LM checkpoint: Hugging Face id or local directory", _LOADERS),
    Option("codec_weights", "codec checkpoint: Hugging Face id or local directory", _LOADERS),
    Option(
        "disable_cuda_graph",
        "run GPU steps eagerly (debugging)",
        ("serve", "gpu_worker", "codec_worker"),
        _parse_bool,
        negatable=False,
        path="gpu.cuda_graphs codec.cuda_graphs",
        invert=True,
    ),
    Option(
        "dtype",
        "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16",
        ("serve", "gpu_worker"),
        path="gpu.dtype",
    ),
    Option(
        "codec_dtype",
        "codec precision: auto (the model's choice), float32, bfloat16, float16",
        ("serve", "codec_worker"),
        choices=("auto", "float32", "bfloat16", "float16"),
        path="codec.dtype",
    ),
    Option(
        "depth_compile",
        "compile the depth step (the codebooks after the first, for models with several per frame) "
        "with torch.compile inside its CUDA graphs (fuses its many small kernels; a minute at "
        "startup): auto (on a GPU with Triton and graphs), on, off (default)",
        ("serve", "gpu_worker"),
        choices=("auto", "on", "off"),
        path="gpu.depth_compile",
    ),
    Option(
        "fused_step",
        "the LM's layers in fused GPU kernels where its model has them and the "
        "sampler's sort, top-k/p and draw as one Triton kernel: shorter steps and first audio; with "
        "the codec held to a share of the same GPU the faster steps take GPU time it needs (on, off: the "
        "default unless the model chooses on; `voxpipe models`)",
        ("serve", "gpu_worker"),
        choices=("on", "off"),
        path="gpu.fused_step",
    ),
    Option(
        "invariant_gemm",
        "GPU: every GEMM of a plain (bf16/fp16) weight in voxpipe's Triton kernel, whose result for a "
        "row does not depend on the rows beside it, so a request's tokens are its own in any batch "
        "(float8 weights are already; --decode-row-tile does it at a weight read per tile): on, off (default)",
        ("serve", "gpu_worker"),
        choices=("on", "off"),
        path="gpu.invariant_gemm",
    ),
    Option(
        "late_launch",
        "GPU: schedule and launch each step just before the step on the device ends (by measured "
        "step times) rather than as soon as the one before it is launched, so a prompt arriving "
        "meanwhile starts a step sooner (on, off: the default unless the model chooses on; `voxpipe models`)",
        ("serve", "gpu_worker"),
        choices=("on", "off"),
        path="gpu.late_launch",
    ),
    Option(
        "prompt_lane",
        "GPU: a prompt that arrives while a step runs starts at once, its first step on a CUDA stream "
        "of its own beside the step in flight, rather than after that step and the next (on, off: the "
        "default unless the model chooses on; `voxpipe models`)",
        ("serve", "gpu_worker"),
        choices=("on", "off"),
        path="gpu.prompt_lane",
    ),
    Option(
        "prompt_lane_max_batch",
        "GPU: the prompt lane starts a prompt only while at most this many requests run; above it "
        "prompts start in the steps (default 96; 0: at any batch)",
        ("serve", "gpu_worker"),
        int,
        path="gpu.prompt_lane_max_batch",
    ),
    Option(
        "prompt_lanes",
        "GPU, with --prompt-lane on: how many prompts may run their first step beside the step in "
        "flight at once, each in a lane of its own (its stream, graphs and buffers; device memory "
        "for each lane's graphs); with 1 a prompt that finds the lane busy waits for it or the next "
        "step (default 1)",
        ("serve", "gpu_worker"),
        int,
        path="gpu.prompt_lanes",
    ),
    Option(
        "codec_compile",
        "compile the codec's regular windows (and a codec stream's merged ones; with "
        "--codec-compile-tails and --codec-compile-leads, tails and leads) with torch.compile "
        "(fuses its elementwise work; tens of seconds at startup, cached on disk): auto (on a GPU "
        "with Triton, when the model has a compiled codec), on, off",
        ("serve", "codec_worker"),
        choices=("auto", "on", "off"),
        path="codec.compile",
    ),
    Option(
        "codec_compile_tails",
        "with --first-chunk progressive: decode the tail windows of a full window (a stream's newest "
        "frame until it switches to regular windows) as regular windows are, in graphs up to "
        "--codec-max-batch and compiled where --codec-compile compiles and the model's compiled codec "
        "takes them (the default; one more compile at startup); off: uncompiled, in graphs of up to --codec-lead-batch",
        ("serve", "codec_worker"),
        _parse_bool,
        path="codec.compile_tails",
    ),
    Option(
        "codec_compile_leads",
        "decode lead windows (a request's first chunk) as regular windows are, in graphs up to "
        "--codec-max-batch and compiled where --codec-compile compiles and the model's compiled codec "
        "takes them (the default; one more compile per lead size at startup, tens of seconds uncached); "
        "off: uncompiled, in graphs of up to --codec-lead-batch",
        ("serve", "codec_worker"),
        _parse_bool,
        path="codec.compile_leads",
    ),
    Option(
        "codec_first_lane",
        "GPU: decode a request's first and second chunks that arrive while a codec pass runs at once, "
        "in graphs of their own on a high-priority CUDA stream, rather than after the pass (a model "
        "without codec streams), and let the gpu_worker send a first chunk after one frame with 15 ms "
        "allowed for the second's trip instead of 25 while its streams are at most "
        "--codec-first-lane-room of its capacity; give it to both workers; off (the default): they "
        "wait for the pass and go first in the next",
        ("serve", "gpu_worker", "codec_worker"),
        _parse_bool,
        path="codec.first_lane",
    ),
    Option(
        "codec_first_lane_room",
        "with --codec-first-lane: the share of its capacity up to which the gpu_worker allows a second "
        "chunk the lane's 15 ms (0.5; 0: never, 1: at any load); nearer the capacity the codec's "
        "passes are long and the load grows under first chunks just sent",
        ("serve", "gpu_worker"),
        float,
        path="codec.first_lane_room",
    ),
    Option(
        "codec_max_batch",
        "windows decoded in one codec call, and the largest codec graph (0 = 128 on GPU, 64 on CPU)",
        ("serve", "codec_worker"),
        int,
        path="codec.max_batch",
    ),
    Option(
        "codec_lead_batch",
        "GPU: the largest batch of uncompiled lead windows (first chunks, but those that "
        "--codec-compile-leads compiles) and of tail windows shorter than a regular window decoded at "
        "once, and their largest codec graph (0 = 16; at most --codec-max-batch): such first chunks "
        "of a burst queue in parts of this many, one after another",
        ("serve", "codec_worker"),
        int,
        path="codec.lead_batch",
    ),
    Option(
        "codec_call_batch",
        "windows per codec call inside a decode (padded): one shape for every call, so a window's "
        "audio is the same bits however it is batched (-1 = 16 on GPU, 4 on CPU; 0 = a graph's whole "
        "batch in one call: faster in large batches, but a window's bits then depend on its batch)",
        ("serve", "codec_worker"),
        int,
        path="codec.call_batch",
    ),
    Option(
        "codec_gather_ms",
        "longest a codec window waits for others to share its decode call, within its listener's "
        "buffered audio (first chunks never wait; 0 = decode on arrival)",
        ("serve", "codec_worker"),
        float,
        path="codec.gather_ms",
    ),
    Option(
        "codec_cudnn_benchmark",
        "GPU: cuDNN picks each codec convolution shape's algorithm by timing them at its first call "
        "instead of by its heuristic: auto for the codec graphs' shapes at startup; on also for a "
        "shape first met while serving (a clip's length, an eager decode), in that request; off",
        ("serve", "codec_worker"),
        choices=("auto", "on", "off"),
        path="codec.cudnn_benchmark",
    ),
    Option(
        "codec_merge",
        "codec streams: a request's waiting windows decode as one window of up to this many (the "
        "sizes its model takes; 1 = each window alone, one decode round per window)",
        ("serve", "codec_worker"),
        int,
        path="codec.merge",
    ),
    Option(
        "codec_streams",
        "codec slots for models whose codec keeps each request's state (one per request being "
        "decoded; 0 = twice the gpu_worker's max batch size plus 16)",
        ("serve", "codec_worker"),
        int,
        path="codec.max_streams",
    ),
    Option(
        "max_batch_size", "0 = 256 on GPU, 16 on CPU", ("serve", "gpu_worker"), int, path="gpu.max_batch_size"
    ),
    Option(
        "max_context",
        "0 = the model's max_tokens",
        ("serve", "gateway", "tokenizer_worker", "gpu_worker"),
        int,
        path="gpu.max_context",
    ),
    Option("page_size", "tokens per KV page", ("serve", "gpu_worker"), int, path="gpu.page_size"),
    Option(
        "max_prefills",
        "prompts one engine step may start (within its prefill graphs); 0 = as many as the fitted step "
        "cost leaves room for beside the running streams, at least one a step",
        ("serve", "gpu_worker"),
        int,
        path="gpu.max_prefills",
    ),
    Option(
        "max_prefill_rows",
        "prompt rows one engine step may start (a longer prompt still starts, alone)",
        ("serve", "gpu_worker"),
        int,
        path="gpu.max_prefill_rows",
    ),
    Option(
        "num_pages",
        "0 = max-batch-size full contexts, or as many pages as the GPU holds past the reserve",
        ("serve", "gpu_worker"),
        int,
        path="gpu.num_pages",
    ),
    Option(
        "decode_row_tile",
        "rows per GEMM in the decode graphs (0 = one GEMM a step): every backbone and head GEMM in tiles of "
        "this many rows, so a request's tokens do not depend on its batch bucket whatever kernel "
        "the GEMM library picks by row count (mixed graphs off); a weight read per tile",
        ("serve", "gpu_worker"),
        int,
        path="gpu.decode_row_tile",
    ),
    Option(
        "gpu_memory_reserve",
        "the share of the GPU's memory the KV cache leaves free (the gpu_worker's graphs and "
        "activations, the codec worker sharing the GPU); with --num-pages 0 the cache shrinks to "
        "fit, and says so",
        ("serve", "gpu_worker"),
        float,
        path="gpu.gpu_memory_reserve",
    ),
    Option(
        "first_chunk",
        "first audio: reference (first full codec window), adaptive (a short lead window when the "
        "measured step rate keeps the stream fed), fastest (always the shortest lead) or progressive "
        "(each first frame as soon as it exists, until the stream is far enough ahead)",
        ("serve", "gpu_worker", "codec_worker"),
        choices=("reference", "adaptive", "fastest", "progressive"),
        path="gpu.first_chunk",
    ),
    Option(
        "first_chunk_margin",
        "the first chunk's jitter margin: it goes out when the steps that make the next window, "
        "this many times their pessimistic time, leave it in time (1..2; lower: more first chunks "
        "after one frame under load, less slack for the second)",
        ("serve", "gpu_worker"),
        float,
        path="gpu.first_chunk_margin",
    ),
    Option(
        "capacity_headroom",
        "admission: the share of a row's playback time (1 / the model's rows per second) that an engine step of "
        "every admitted stream, at the context each attends over on average in its life, may take "
        "by the gpu_worker's fitted step cost; lower keeps more margin against streams aging "
        "together and uneven steps, higher admits more streams per GPU (0.5..1.0)",
        ("serve", "gpu_worker"),
        float,
        path="gpu.capacity_headroom",
    ),
    Option(
        "realtime_headroom",
        "the share of a row's playback time that an engine step may take: admission's budget until "
        "the step cost is fitted (the first ~200 steps), and the budget that streams sitting out "
        "keep steps under (0.5..1.0)",
        ("serve", "gpu_worker"),
        float,
        path="gpu.realtime_headroom",
    ),
    Option(
        "sit_out",
        "seconds of audio in hand (sent, not yet played) past which a stream may sit out steps "
        "while steps take longer than the headroom allows, so that the others' steps are shorter "
        "and new requests keep being admitted; 0 = every running stream is in every step",
        ("serve", "gpu_worker"),
        float,
        path="gpu.sit_out_lead_s",
    ),
    Option(
        "max_lead",
        "seconds of audio in hand (sent, not yet played) past which a stream leaves every step out "
        "until its listener catches up (at least 1; 0 = no cap): where the codec bounds the streams, "
        "rows generated far ahead take the GPU time the codec needs now",
        ("serve", "gpu_worker"),
        float,
        path="gpu.max_lead_s",
    ),
    Option(
        "lead_borrow",
        "while prompts wait, let a step run past the headroom by the audio every playing stream's "
        "listener has in hand beyond what its next chunk needs (at most twice the headroom), so that "
        "a burst starts more prompts a step; off: every step keeps within the headroom",
        ("serve", "gpu_worker"),
        _parse_bool,
        path="gpu.lead_borrow",
    ),
    Option(
        "lead_borrow_max",
        "with --lead-borrow, the most a step may take, in step budgets (1: no borrowing); more starts "
        "more of a burst's prompts a step, and their first chunks wait on those longer steps",
        ("serve", "gpu_worker"),
        float,
        path="gpu.lead_borrow_max",
    ),
    Option(
        "first_audio_sit_out",
        "with --first-chunk progressive: while a stream waits for its first chunk or still sends tail "
        "windows, streams with --sit-out's audio in hand sit out so that a step comes to the pace that "
        "sends a first frame alone (first audio after one frame under load); off: streams sit out only "
        "steps over the headroom",
        ("serve", "gpu_worker"),
        _parse_bool,
        path="gpu.first_audio_sit_out",
    ),
    Option(
        "trust_startup_steps",
        "a fresh worker admits up to what its startup steps (the largest batches, timed before "
        "serving) say it keeps real time, each step taken up to 1.3 times their forward pass "
        "(less as the steps served come near that batch), so that a burst is admitted at once; off: the "
        "capacity grows past the load served by measuring its way there",
        ("serve", "gpu_worker"),
        _parse_bool,
        path="gpu.trust_startup_steps",
    ),
    Option(
        "lm_head",
        "full (whole vocabulary), audio (logits only for codec tokens and stop: less work per step; "
        "text tokens can no longer be sampled) or auto (audio on a CPU, full on a GPU)",
        ("serve", "gpu_worker"),
        choices=("auto", "full", "audio"),
        path="gpu.lm_head",
    ),
    Option(
        "quantization",
        "none, or fp8 (LM linear layers in float8 with per-channel scales; GPU with fp8 tensor cores)",
        ("serve", "gpu_worker"),
        choices=("none", "fp8"),
        path="gpu.quantization",
    ),
    Option(
        "kv_cache_dtype",
        "auto (keys and values in the model's dtype) or fp8 (float8 e4m3, unscaled: half the bytes "
        "attention reads per step and half the memory for the same pages)",
        ("serve", "gpu_worker"),
        choices=("auto", "fp8"),
        path="gpu.kv_cache_dtype",
    ),
    Option(
        "decode_attention",
        "the decode steps' attention kernel: flashinfer, xqa (TensorRT-LLM's, on SM 9.x/10.x/12.x; over "
        "an fp8 cache it attends in fp8), or auto (xqa for an fp8 cache on Hopper, else flashinfer)",
        ("serve", "gpu_worker"),
        choices=("auto", "flashinfer", "xqa"),
        path="gpu.decode_attention",
    ),
    Option(
        "constrained",
        "keep sampled tokens valid codes for their frame position (default: the model's choice)",
        ("serve", "gateway"),
        _parse_bool,
        path="gateway.constrained",
    ),
    Option(
        "max_text_chars", "longest accepted text", ("serve", "gateway"), int, path="gateway.max_text_chars"
    ),
    Option(
        "max_queue",
        "requests waiting for a stream beyond this get 503",
        ("serve", "gateway"),
        int,
        path="gateway.max_queue",
    ),
    Option(
        "queue_timeout",
        "seconds a request may wait for a stream before it gets 503",
        ("serve", "gateway"),
        float,
        path="gateway.queue_timeout",
    ),
    Option(
        "max_streams",
        "requests streaming at once (0 = the capacity the gpu_workers measure, else their batch size)",
        ("serve", "gateway"),
        int,
        path="gateway.max_streams",
    ),
    Option(
        "body_timeout",
        "seconds a client may take to send its request body before it gets 408",
        ("serve", "gateway"),
        float,
        path="gateway.body_timeout",
    ),
    Option(
        "send_timeout",
        "seconds a streaming client may take to take a write of its audio (it stopped reading) before "
        "its connection is dropped and its stream's slot freed",
        ("serve", "gateway"),
        float,
        path="gateway.send_timeout",
    ),
    Option(
        "ws_idle_timeout",
        "seconds a WebSocket session may send nothing while nothing is generating before it is closed",
        ("serve", "gateway"),
        float,
        path="gateway.ws_idle_timeout",
    ),
    Option(
        "max_reference_bytes",
        "the largest reference clip (an audio file, for voice cloning) a request may carry, in bytes",
        ("serve", "gateway"),
        int,
        path="gateway.max_reference_bytes",
    ),
    Option(
        "max_reference_seconds",
        "the longest reference clip a request may carry, in seconds",
        ("serve", "gateway"),
        float,
        path="gateway.max_reference_seconds",
    ),
    Option(
        "reference_cache_mb",
        "MiB of encoded reference clips the gateway keeps, so a repeated clip is not encoded again",
        ("serve", "gateway"),
        int,
        path="gateway.reference_cache_mb",
    ),
    Option(
        "encode_timeout",
        "seconds a request waits for its reference clip's encoding before it gets 504",
        ("serve", "gateway"),
        float,
        path="gateway.encode_timeout",
    ),
    Option(
        "voices_dir",
        "directory of the saved voices (POST /v1/audio/voices), read at start; empty = kept in memory only",
        ("serve", "gateway"),
        path="gateway.voices_dir",
    ),
    Option(
        "heartbeat_timeout",
        "seconds without a heartbeat before a process's requests fail where the gateway cannot see "
        "that it exited (on another host or container); on this host an exited process fails them at once",
        ("serve", "gateway"),
        float,
        path="gateway.heartbeat_timeout",
    ),
    Option(
        "api_key_file",
        "file holding the Bearer key the HTTP API requires (or set VOXPIPE_API_KEY; never a flag)",
        ("serve", "gateway"),
        path="gateway.api_key_file",
    ),
    Option(
        "zmq_curve_dir",
        "CURVE keys (from `voxpipe keys DIR`) that encrypt and authenticate every tcp:// socket",
        _ALL,
    ),
    Option(
        "zmq_insecure",
        "accept tcp:// peers without CURVE keys although an address reaches beyond this host (only on a "
        "network you trust; without keys such a process refuses to start)",
        _ALL,
        _parse_bool,
        negatable=False,
    ),
    Option("log_level", "DEBUG, INFO, WARNING, ERROR", _ALL),
    Option(
        "threads",
        "CPU threads of each process's compute (torch, OpenMP, MKL); 0: by role and host (gateway and "
        "tokenizer workers 1, gpu_worker and codec_worker processes split the cores)",
        _ALL,
        int,
    ),
    Option(
        "mps",
        "CUDA MPS for the gpu_worker and codec_worker: on (start a private MPS daemon; its kernels "
        "and the LM's then run side by side instead of taking turns), auto (on when "
        "nvidia-cuda-mps-control is installed and a CUDA client works under its daemon) or off",
        ("serve",),
        choices=("off", "on", "auto"),
    ),
    Option(
        "codec_gpu_share",
        "with MPS: the percent of the GPU's SMs the codec_worker's kernels may occupy "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so that its passes leave the rest to the LM's steps; 0 = all",
        ("serve",),
        int,
        path="codec.gpu_share",
    ),
    Option("run_dir", "directory for ipc:// sockets and taps (default: a private temp dir)", ("serve",)),
    Option(
        "requests",
        "requests to the tokenizer pool (gateway binds)",
        _address_roles("requests"),
        kind="address",
    ),
    Option("gateway_in", "the gateway's inbox (gateway binds)", _address_roles("gateway_in"), kind="address"),
    Option(
        "gpu_in",
        "prompts and aborts to the gpu_workers (gateway binds, gpu_workers connect)",
        _address_roles("gpu_in"),
        kind="address",
    ),
    Option(
        "codec_in",
        "the codec_worker's inbox (codec_worker binds; each gpu_worker/codec_worker pair its own)",
        _address_roles("codec_in"),
        kind="address",
    ),
    Option("name", "process name in /ready and logs", SERVICES, kind="process"),
    Option(
        "tap",
        "mirror this process's sends on a PUB socket bound here (see `voxpipe tap`)",
        SERVICES,
        kind="process",
    ),
)


def options_for(role: str) -> list[Option]:
    return [o for o in OPTIONS if role in o.roles]


def add_options(parser: argparse.ArgumentParser, role: str) -> None:
    """The role's flags. Every default is None, so `resolve` can tell a flag from an absent one."""
    d = ServeConfig()
    defaults = {
        **{o.field: o.default(d) for o in OPTIONS if o.kind == "config"},
        **{f: a for f, a in msgspec.structs.asdict(Addresses.tcp()).items()},
    }
    if role != "serve":
        parser.add_argument(
            "--config-json", help="the deployment's ServeConfig as JSON (written by `voxpipe serve`)"
        )
    for opt in options_for(role):
        shown = defaults.get(opt.field, "")
        help = (
            f"{opt.help} [env {opt.env}; default {shown!r}]"
            if shown not in ("", None)
            else f"{opt.help} [env {opt.env}]"
        )
        if opt.type is _parse_bool:
            action = argparse.BooleanOptionalAction if opt.negatable else "store_true"
            parser.add_argument(opt.flag, action=action, default=None, help=help)
        else:
            conv = opt.type if opt.type in (int, float) else str
            parser.add_argument(opt.flag, type=conv, default=None, choices=opt.choices or None, help=help)


@dataclass
class RoleSettings:
    """What one process runs with: the deployment's config, its own name and tap address, and the
    settings the model chose for it (`model_defaults`: those no flag or variable set)."""

    cfg: ServeConfig
    name: str
    tap: str
    chosen: dict[str, Any] = field(default_factory=dict)


def default_name(role: str) -> str:
    # Replicas of the tokenizer service share a command line: host name and pid keep them apart.
    if role == "tokenizer_worker":
        return f"tokenizer_worker.{socket.gethostname()}.{os.getpid()}"
    return role


def as_flags(settings: Mapping[str, Any]) -> str:
    """Settings (option field → value) as the command line gives them."""
    opts = {o.field: o for o in OPTIONS}
    return " ".join(
        (opts[k].flag if v else "--no-" + opts[k].flag[2:]) if isinstance(v, bool) else f"{opts[k].flag} {v}"
        for k, v in settings.items()
    )


def model_defaults(model: str) -> dict[str, Any]:
    """The settings the model's spec chooses for itself (`serve_defaults`: option field → value,
    those it serves best with as measured), for the roles that load models; {} for an unknown
    model (the roles that load it say why). The gateway never calls this: it imports no program."""
    from programs import get_spec, served_name

    try:
        spec = get_spec(served_name(model))
    except ValueError:
        return {}
    return dict(spec.get("serve_defaults", {}))


def resolve(role: str, ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RoleSettings:
    """Flags, then VOXPIPE_* variables (unless --config-json), then the model's own defaults
    (`model_defaults`), then ServeConfig's. Raises ValueError naming the flag and variable to fix."""
    environ = os.environ if environ is None else environ
    from_json = getattr(ns, "config_json", None)
    try:
        cfg = ServeConfig.from_json(from_json) if from_json else ServeConfig()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"--config-json is not a valid ServeConfig: {e}") from None
    values: dict[str, Any] = {}
    for opt in options_for(role):
        value = getattr(ns, opt.field, None)
        if value is None and not from_json and environ.get(opt.env, "") != "":
            try:
                value = opt.type(environ[opt.env])
            except ValueError as e:
                raise ValueError(f"{opt.env}={environ[opt.env]!r} is not valid for {opt.flag}: {e}") from None
            if opt.choices and value not in opt.choices:
                raise ValueError(f"{opt.env} must be one of {', '.join(opt.choices)}, got {value!r}")
        if value is not None:
            values[opt.field] = value
    chosen: dict[str, Any] = {}
    if not from_json and role in _LOADERS:
        fields = {o.field for o in options_for(role)}
        for name, value in model_defaults(values.get("model") or cfg.model).items():
            if name in fields and name not in values:
                values[name] = chosen[name] = value
    name = values.pop("name", None) or default_name(role)
    tap = values.pop("tap", "")
    addr_fields = {o.field for o in OPTIONS if o.kind == "address"}
    given = {f: values.pop(f) for f in list(values) if f in addr_fields}
    if role != "serve":
        base = cfg.addresses or (Addresses.local(cfg.run_dir) if cfg.run_dir else Addresses.tcp())
        cfg.addresses = msgspec.structs.replace(base, **given)
        _check_connects(role, cfg.addresses)
    opts = {o.field: o for o in OPTIONS}
    for f, v in values.items():
        opts[f].apply(cfg, v)
    return RoleSettings(cfg, name, tap, chosen)


def _check_connects(role: str, addresses: Addresses) -> None:
    opts = {o.field: o for o in OPTIONS}
    for f in ROLE_SOCKETS[role][1]:
        addr = getattr(addresses, f)
        if not addr.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"{opts[f].flag} / {opts[f].env} must be a tcp:// or ipc:// address, got {addr!r}"
            )
        if is_wildcard(addr):
            raise ValueError(
                f"{opts[f].flag} / {opts[f].env} is {addr!r}, a bind address, but {role} connects to it: "
                f"give the host that binds it, e.g. tcp://{_binder(f)}:{addr.rpartition(':')[2]}"
            )


def _binder(field: str) -> str:
    return next(r for r, (binds, _) in ROLE_SOCKETS.items() if field in binds)


def role_parser(role: str, prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or f"python -m {role}",
        description=f"Run the {role} as a service. Settings come from flags or VOXPIPE_* variables.",
    )
    add_options(parser, role)
    return parser


def parse_role(
    role: str, argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> RoleSettings:
    """`python -m <role>`'s command line → settings; exits with a usage error on a bad value."""
    parser = role_parser(role)
    ns = parser.parse_args(argv)
    try:
        return resolve(role, ns, environ)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
