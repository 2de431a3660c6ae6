"""The settings of one deployment, grouped by the process that takes them, with one default each.

`ServeConfig` holds what every process shares (the model, its weights, devices, addresses, logging)
and one struct per kind of process: `GatewaySettings`, `TokenizerSettings`, `GpuWorkerSettings`,
`CodecSettings`. `voxpipe serve` builds one and hands it to each child as JSON (`--config-json`),
so all processes agree; a process run as a service builds it from flags and `VOXPIPE_*` variables
(common/options.py). Each struct checks its own values (`check`), raising ValueError that names
the flag to fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from common.ipc import Addresses

# `--sit-out`: a stream sitting out keeps at least this much audio in hand, more than its next chunk
# can take to arrive (a window's steps, a codec pass, the delivery: ~0.15 s under load).
MIN_SIT_OUT_S = 0.25
# The gateway's cap on `--max-text-chars` (gateway/segments.py MAX_TEXT_CHARS_LIMIT).
MAX_TEXT_CHARS = 50_000


def check_sit_out(spare_s: float) -> None:
    """`--sit-out` (for `voxpipe serve`, and the engine of a gpu_worker run alone)."""
    if not (spare_s == 0 or MIN_SIT_OUT_S <= spare_s < float("inf")):
        raise ValueError(
            f"--sit-out must be 0 (off) or seconds of audio in hand >= {MIN_SIT_OUT_S}, got {spare_s}"
        )


def check_first_audio_sit_out(on: bool, first_chunk: str) -> None:
    """`--first-audio-sit-out` (for `voxpipe serve`, and the engine of a gpu_worker run alone)."""
    if on and first_chunk != "progressive":
        raise ValueError("--first-audio-sit-out needs --first-chunk progressive")


def check_prompt_lanes(lanes: int) -> None:
    """`--prompt-lanes` (for `voxpipe serve`, and the engine of a gpu_worker run alone)."""
    if lanes < 1:
        raise ValueError(
            f"--prompt-lanes is how many prompts may run their first step beside the step in flight "
            f"at once (with --prompt-lane on): 1 or more, got {lanes}"
        )


def check_headroom(headroom: float, flag: str = "--realtime-headroom") -> None:
    """`--realtime-headroom` or `--capacity-headroom` (for `voxpipe serve`, and the engine of a
    gpu_worker run alone)."""
    if not 0.5 <= headroom <= 1.0:
        raise ValueError(f"{flag} must be in 0.5..1.0, got {headroom}")


class GatewaySettings(msgspec.Struct, kw_only=True):
    """The gateway's HTTP side and admission queue."""

    host: str = "127.0.0.1"  # HTTP bind address
    port: int = 8000
    # Connections the kernel holds for the gateway to accept (listen(2)'s backlog; the kernel caps it
    # at net.core.somaxconn). A burst of clients connecting at once beyond it has its SYNs dropped,
    # and each of those connects ~1 s later, when its SYN is retried: with aiohttp's default of 128,
    # most connects of a burst of 384 on the H200 wait for the retry (the bursts' taps).
    listen_backlog: int = 4096
    constrained: bool | None = None  # None = the model's default
    max_text_chars: int = 2000
    max_queue: int = 1024  # requests waiting for a slot beyond this get 503
    queue_timeout: float = 30.0  # seconds a request may wait for a stream before a 503
    max_streams: int = 0  # active streams admitted at once (0 = what the gpu_workers measure)
    body_timeout: float = 30.0  # seconds a client may take to send a request body before a 408
    # Seconds a streaming client may take to take one write of its audio (its buffers full: it
    # stopped reading) before it is taken for gone and its connection dropped, so that a client
    # that never reads cannot hold a stream's slot at admission for good.
    send_timeout: float = 60.0
    api_key_file: str = ""  # file holding the HTTP API's Bearer key (or VOXPIPE_API_KEY)
    # Seconds a process may send no heartbeat before its requests fail, where the gateway cannot
    # see that it exited (another host or container; a hung one). Slow is not dead: a stall under
    # load or a long GC shorter than this costs no request (gateway/procs.py).
    heartbeat_timeout: float = 10.0
    # Seconds a WebSocket session may stay silent (no client message) with nothing to generate or
    # send before the gateway closes it (code 1000).
    ws_idle_timeout: float = 60.0
    # Reference clips (voice cloning): the largest audio file a request may carry, its longest
    # duration, the bytes of encoded clips kept to serve a repeated clip without encoding it, and
    # how long a request waits for its clip's encoding before a 504.
    max_reference_bytes: int = 10 << 20
    max_reference_seconds: float = 30.0
    reference_cache_mb: int = 256
    encode_timeout: float = 60.0
    voices_dir: str = ""  # where saved voices are kept ("" = in memory: lost on a restart)

    def check(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.listen_backlog < 1:
            raise ValueError(f"--listen-backlog must be at least 1, got {self.listen_backlog}")
        if self.max_queue < 0 or self.max_streams < 0 or not 0 < self.queue_timeout < float("inf"):
            raise ValueError(
                "--max-queue and --max-streams must be >= 0 and --queue-timeout a positive number"
            )
        if not 0 < self.body_timeout < float("inf"):
            raise ValueError(f"--body-timeout must be a positive number of seconds, got {self.body_timeout}")
        if not 0 < self.send_timeout < float("inf"):
            raise ValueError(f"--send-timeout must be a positive number of seconds, got {self.send_timeout}")
        if not 0 < self.ws_idle_timeout < float("inf"):
            raise ValueError(
                f"--ws-idle-timeout must be a positive number of seconds, got {self.ws_idle_timeout}"
            )
        if not 1 <= self.heartbeat_timeout < float("inf"):
            raise ValueError(f"--heartbeat-timeout must be at least 1 second, got {self.heartbeat_timeout}")
        if self.max_reference_bytes < 1 or not 0 < self.max_reference_seconds <= 600:
            raise ValueError(
                "--max-reference-bytes must be >= 1 and --max-reference-seconds in (0, 600], got "
                f"{self.max_reference_bytes} and {self.max_reference_seconds}"
            )
        if self.reference_cache_mb < 0 or not 0 < self.encode_timeout < float("inf"):
            raise ValueError("--reference-cache-mb must be >= 0 and --encode-timeout a positive number")
        if not 1 <= self.max_text_chars <= MAX_TEXT_CHARS:
            raise ValueError(f"--max-text-chars must be in 1..{MAX_TEXT_CHARS}, got {self.max_text_chars}")


class TokenizerSettings(msgspec.Struct, kw_only=True):
    """The tokenizer pool (prompt builders)."""

    # serve: prompt-builder processes to start; gateway: how many must be ready for /ready
    workers: int = 1

    def check(self) -> None:
        if self.workers < 1:
            raise ValueError("--tokenizer-workers must be at least 1")


class GpuWorkerSettings(msgspec.Struct, kw_only=True):
    """The gpu_worker's engine: batch, KV cache, graphs, attention, admission and pacing."""

    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    max_batch_size: int = 0  # 0 = 256 on GPU, 16 on CPU
    max_context: int = 0  # 0 = the model's max_tokens
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # 0 = room for max_batch_size full contexts, as far as the GPU holds them
    # The share of the GPU's memory the KV cache leaves free: the gpu_worker's graphs and
    # activations, and the codec worker where it shares the GPU (its weights and graphs: over 10 GB
    # for Higgs's decoder with merged windows). 0.15 of an H200 is 21 GB.
    gpu_memory_reserve: float = 0.15
    max_prefill_rows: int = 8192  # prompt rows per step, so one step never grows unbounded
    # Prompts one step may start (within the GPU runner's own bound, its prefill graphs); 0 = as many
    # as the fitted step cost leaves room for beside the running streams' rows (at least one a step).
    max_prefills: int = 0
    cuda_graphs: bool = True  # GPU only: replay captured graphs (--disable-cuda-graph: eager steps)
    min_decode_batch: int = 1  # smallest decode graph: smaller batches are padded up to it
    # > 0: the decode graphs run every backbone and head GEMM (those through
    # programs.blocks.fp8.linear) in tiles of exactly this many rows, the last padded
    # (`fp8.row_tiles`), and mixed graphs are off:
    # a decode row's bits then do not depend on its bucket, whatever kernel the GEMM library would
    # pick by row count. Costs a weight read per tile, and a tile's padding at small batches.
    decode_row_tile: int = 0
    # FlashInfer: one KV split per request, so attention reduces in the same order at any batch
    # size (measured on the H200: without it, greedy tokens change when the batch grows).
    no_split_kv: bool = True
    # First audio of a request: "reference" waits for the first full window (`detok_interval` rows);
    # "adaptive" sends a short lead window (the program's `detok_lead`) as soon as the measured
    # step rate lets the next window arrive before the lead has played out; "fastest" always
    # sends the smallest lead (deterministic: for tests); "progressive" sends each first frame as a
    # tail window as soon as it exists, until the stream is far enough ahead (gpu_worker/windows.py).
    first_chunk: str = "adaptive"
    # The first chunk's jitter margin: it goes out (a lead window, a progressive first frame) only
    # when the steps that make the next window, this many times their pessimistic time (the 95th
    # percentile of recent spans), leave it in time (gpu_worker.scheduler.pacing.lead_fits). Lower
    # sends more first chunks after one frame under load, and spends the second chunk's slack
    # (bench/admission_sim.py --first-margin weighs it); at least 1. The default is lead_fits's
    # (gpu_worker.scheduler.pacing.LEAD_MARGIN).
    first_chunk_margin: float = 1.15
    # Admission (gpu_worker.scheduler.pacing.StepClock.capacity): the load whose step, every stream
    # in it at its life-average context, takes at most this share of a row's playback time by the
    # fitted step cost (StepCost.capacity). The rest, and the streams' leads (SitOut), carry the
    # steps of streams that age together (a ramp's) and what the linear fit misses near a full GPU.
    # On the H200 (fp8, MPS, closed-loop 1024-token streams, 480 clients) 0.92 fills ~419-427
    # streams, every one on time; 0.94 fills ~395-411 with 43 % of requests late at their end, and
    # 0.95 fills 435 with 53 % late. (The simulation, bench/admission_sim.py, whose GPU is linear,
    # keeps every stream on time at 0.95.)
    capacity_headroom: float = 0.92
    # ... and until that is fitted, the largest load whose step takes at most this share; also the
    # step budget that streams sitting out keep steps under (gpu_worker.scheduler.sit_out.SitOut).
    # A stream's lead, and its switch to regular windows, build from the surplus. On the H200 (fp8
    # weights and cache, closed-loop 1024-token streams) 0.88 keeps 99.3-100 % of requests on time
    # at every level from 320 to 384 streams; 0.92, 98.7 % at 384; 0.8 admits ~10 % fewer.
    realtime_headroom: float = 0.88
    # Streams with this much audio in hand (seconds) may sit out steps that run over the budget
    # (gpu_worker.scheduler.sit_out.SitOut), which shortens the steps of those with less; 0 = never.
    # Far beyond what a chunk's trip takes (a codec pass and the delivery: tens of milliseconds), so
    # a stream sitting out never comes near a gap; half a second lasts ~40 steps.
    sit_out_lead_s: float = 0.5
    # Seconds of audio in hand past which a stream leaves every step out until its listener catches
    # up; 0 = no cap. Where the codec bounds the streams (a heavy vocoder sharing the GPU), rows
    # generated far ahead of playback take GPU time the codec needs now.
    max_lead_s: float = 0.0
    # While prompts wait, a step may take longer than the budget by what every playing stream's
    # listener has in hand beyond its next chunk's wait (gpu_worker.scheduler.pacing.step_allowance),
    # up to `lead_borrow_max` budgets in all: a burst starts more prompts a step where the streams
    # running can spare it. Off: every step keeps the budget.
    lead_borrow: bool = True
    lead_borrow_max: float = 2.0  # gpu_worker.scheduler.pacing.BORROW_MAX
    # With progressive first chunks: while a running stream waits for its first chunk or still sends
    # tail windows, streams with --sit-out's audio in hand (0.5 s when it is off) sit out so that a
    # step, by the fitted cost, comes to the pace that sends a first frame alone
    # (gpu_worker.scheduler.sit_out.FirstAudioSitOut). Off: only steps over the budget leave
    # streams out.
    first_audio_sit_out: bool = False
    # A fresh worker's capacity from the largest batches its startup steps timed, as if served
    # (gpu_worker.scheduler.pacing.StepClock: each step taken up to STARTUP_SLOWNESS times the
    # forward pass they timed, less as the steps served come near that batch): a burst on a fresh
    # worker is admitted up to that at once. Off: the startup steps start the fit, and the capacity
    # grows past the load served by measuring its way (a fresh H200 reports ~195 streams at first,
    # ~370-380 once served).
    trust_startup_steps: bool = True
    # "full" vocabulary, or "audio": logits for codec tokens + stop only; "auto": audio where the LM
    # runs on the CPU, full on a GPU (`head_for`). On a CPU the full head's rows (a text LLM's whole
    # vocabulary) are most of a small model's step: the default model on 2 cores steps in ~4 ms
    # with the audio head against ~13 ms with the full one (`voxpipe bench`, row_period_ms).
    lm_head: str = "auto"
    quantization: str = "none"  # none | fp8 (LM linear weights in float8, per-channel scales)
    # Keys/values: "auto" stores them in the model's dtype; "fp8" in float8 e4m3 with scale 1
    # (attention reads half the bytes; queries and outputs stay in the model's dtype).
    kv_cache_dtype: str = "auto"
    # The decode steps' attention: "flashinfer", "xqa" (gpu_worker.attention.xqa) or "auto" (xqa for
    # an fp8 cache on Hopper). Prefill rows always run on FlashInfer.
    decode_attention: str = "auto"
    # FlashInfer's decode kernel: on tensor cores (its FA2 prefill kernel; 0.85-0.89x the time of the
    # CUDA-core kernel for a 3B Llama's bf16 cache on the H200), or the CUDA-core decode kernel
    # (bench/attention_kv.py compares them; with an fp8 cache it is not measured). Only the
    # tensor-core kernel honours `no_split_kv`: the CUDA-core one splits a small batch's KV in chunks
    # sized by the batch (FlashInfer's decode work estimation), so its rows round by batch.
    decode_tensor_cores: bool = True
    # A step's first new prompt runs in one graph with its decode rows (gpu_worker.runner.graphs, mixed
    # graphs) when the program allows it; False: in a prefill graph of its own.
    mixed_prefill: bool = True
    # The depth step (a program's `decode_tokens`, several codebooks per row) under torch.compile
    # inside its graphs: "auto" (on a GPU with Triton and graphs), "on", "off" (the default: its
    # compile time at startup is not measured yet). It is dozens of tiny sequential kernels per
    # codebook; fused, fewer.
    depth_compile: str = "off"
    # "on": the LM's layers in fused kernels where its program has them (`fuse_layers`) and the
    # sampler's tail (sort, top-k/p, min-p, the draw) as one Triton kernel (runner/sample_kernel.py).
    # Off unless the model chooses it (its spec's serve_defaults): on the H200 it shortens
    # a 16-codebook model's step from 12.1 to 7.6 ms at batch 1 and its first audio from 28 to 21 ms;
    # with the codec held to a share of the SMs under MPS the faster steps leave the codec less of
    # the GPU (docs/models/, that model's Serving settings).
    fused_step: str = "off"
    # "on": every GEMM of a plain (bf16/fp16) weight through programs.blocks.fp8.linear (a model's
    # backbone and heads; all of a program's with `mixed_prefill`), in every graph and eager step,
    # in voxpipe's Triton kernel (programs/blocks/invariant_gemm.py), whose reduction order
    # depends on the weight's shape alone, so a row's result does not depend on the rows beside it:
    # a request's tokens are its own in any batch with bf16 weights, as float8 ones give
    # (`--quantization fp8`) and as `--decode-row-tile` gives at a weight read per tile. GPU only.
    invariant_gemm: str = "off"
    # "on": the next step is scheduled and launched just before the step on the device ends (by
    # the steps' measured device time, less the host's launch time and a margin that keeps the GPU
    # from idling), not as soon as the step before it was launched: a prompt that arrives meanwhile
    # starts in that next step, a step sooner. GPU only.
    late_launch: str = "off"
    # "on": a prompt that arrives while a step runs starts at once in the prompt lane, its first
    # step on a CUDA stream of its own beside the step in flight (gpu_worker/runner/prompt_lane.py),
    # rather than waiting for that step and the next; it joins the steps from its second row.
    prompt_lane: str = "off"
    # The prompt lane starts a prompt only while at most this many requests run (0: at any batch).
    # Its first step is work beside the step, not in it: measured on the H200 it shortened first
    # audio at every Poisson rate whose batch stayed under ~90, and at a batch of 115-160 it
    # lengthened the steps and a few requests had a late chunk (docs/operations.md, --prompt-lane).
    prompt_lane_max_batch: int = 96
    # With the prompt lane on: lanes of their own (a stream, input arena, attention workspace, graphs
    # and sampling inputs each), so that this many prompts can start beside the step in flight at
    # once; with one, a prompt that arrives while the lane is busy waits for it or the next step.
    # Each lane's graphs take device memory of their own, after the KV cache (out of
    # --gpu-memory-reserve).
    prompt_lanes: int = 1

    def check(self) -> None:
        if self.depth_compile not in ("auto", "on", "off"):
            raise ValueError(f"--depth-compile is auto, on or off, not {self.depth_compile!r}")
        if self.fused_step not in ("on", "off"):
            raise ValueError(f"--fused-step is on or off, not {self.fused_step!r}")
        if self.invariant_gemm not in ("on", "off"):
            raise ValueError(f"--invariant-gemm is on or off, not {self.invariant_gemm!r}")
        if self.late_launch not in ("on", "off"):
            raise ValueError(f"--late-launch is on or off, not {self.late_launch!r}")
        if self.prompt_lane not in ("on", "off"):
            raise ValueError(f"--prompt-lane is on or off, not {self.prompt_lane!r}")
        check_prompt_lanes(self.prompt_lanes)
        if self.prompt_lane_max_batch < 0:
            raise ValueError(
                f"--prompt-lane-max-batch must be >= 0 (0: any), got {self.prompt_lane_max_batch}"
            )
        if self.page_size < 1 or self.max_batch_size < 0 or self.max_context < 0 or self.num_pages < 0:
            raise ValueError(
                "--page-size must be positive; --max-batch-size, --max-context, --num-pages >= 0"
            )
        if self.decode_row_tile < 0:
            raise ValueError(f"--decode-row-tile must be >= 0 (0 = off), got {self.decode_row_tile}")
        if not 1.0 <= self.lead_borrow_max <= 16.0:
            raise ValueError(
                f"--lead-borrow-max must be from 1 to 16 step budgets, got {self.lead_borrow_max:g}"
            )
        if self.max_prefills < 0 or self.max_prefill_rows < 1:
            raise ValueError("--max-prefills must be >= 0 (0 = by the step cost); --max-prefill-rows >= 1")
        if not 0 <= self.gpu_memory_reserve < 1:
            raise ValueError(
                f"--gpu-memory-reserve is a share of the GPU's memory in [0, 1), got {self.gpu_memory_reserve}"
            )
        check_headroom(self.realtime_headroom)
        check_headroom(self.capacity_headroom, "--capacity-headroom")
        check_sit_out(self.sit_out_lead_s)
        if not 1.0 <= self.first_chunk_margin <= 2.0:
            raise ValueError(
                f"--first-chunk-margin is a factor on the steps' pessimistic time in [1, 2], got {self.first_chunk_margin}"
            )
        check_first_audio_sit_out(self.first_audio_sit_out, self.first_chunk)
        if self.max_lead_s and self.max_lead_s < 1.0:
            raise ValueError(f"--max-lead caps audio in hand at 1 s or more (0 = off), got {self.max_lead_s}")

    def head_for(self, device: str) -> str:
        """The LM head a gpu_worker on `device` computes: `lm_head`, with auto resolved."""
        if self.lm_head != "auto":
            return self.lm_head
        return "audio" if device == "cpu" else "full"

    def context_limit(self, max_tokens: int) -> int:
        """The longest context a request may reach: `max_context`, within the model's `max_tokens`."""
        return min(self.max_context or max_tokens, max_tokens)

    def filled(self, device: str, max_tokens: int) -> GpuWorkerSettings:
        """A copy whose batch size and context left at 0 take the device's and the model's default."""
        if self.max_batch_size and self.max_context:
            return self
        return msgspec.structs.replace(
            self,
            max_batch_size=self.max_batch_size or (16 if device == "cpu" else 256),
            max_context=self.max_context or max_tokens,
        )

    def resolved(self, device: str, max_tokens: int) -> GpuWorkerSettings:
        """What a gpu_worker serves with: `filled`, the context within the model's `max_tokens`."""
        return msgspec.structs.replace(
            self.filled(device, max_tokens), max_context=self.context_limit(max_tokens)
        )


class CodecSettings(msgspec.Struct, kw_only=True):
    """The codec_worker: its device, precision, graphs and batching."""

    device: str = "auto"  # auto = the gpu_worker's device; a list like --device
    dtype: str = "auto"  # auto = the model's choice (its program's codec_dtype)
    # auto | on | off: torch.compile of regular windows (codec streams' merged ones too; with
    # `compile_tails`, a full window's tails; with `compile_leads`, the model's compiled lead sizes)
    compile: str = "auto"
    # With progressive first chunks: the tail windows of a regular window's rows (a stream's newest
    # frame until it switches to regular windows) decoded as regular windows are, in graphs up to
    # `max_batch`, and compiled where the model's compiled codec takes them and `compile` compiles
    # (else, or after their compile failed under auto, uncompiled in those larger graphs). Off: as
    # lead windows, uncompiled in graphs of up to `lead_batch`.
    compile_tails: bool = True
    # Lead windows (a request's first chunk, decoded whole) of the sizes the model's compiled codec
    # takes, likewise: compiled where `compile` compiles, in graphs up to `max_batch` (a burst's
    # streams send their first chunks together); each size one more compile at startup (tens of
    # seconds, uncached). Off: uncompiled, in graphs of up to `lead_batch`.
    compile_leads: bool = True
    # GPU graphs, a model without codec streams: a request's first and second chunks that arrive
    # while a pass decodes are decoded at once in graphs of their own on a high-priority CUDA stream
    # (codec_worker/codec.py, FirstLane), not after the pass, and the gpu_worker allows less for a
    # second chunk's trip while its streams are at most `first_lane_room` of its capacity
    # (gpu_worker/windows.py, LANE_DELIVERY_S, LANE_ROOM); off: they wait for the pass and go first
    # in the next.
    first_lane: bool = False
    # With `first_lane`: the share of the capacity it reports up to which the gpu_worker allows the
    # lane's shorter trip (0: never, 1: at any load; LANE_ROOM by default, gpu_worker/windows.py)
    first_lane_room: float = 0.5
    max_batch: int = 0  # windows per decode call (0 = 128 on GPU, 64 on CPU)
    # GPU graphs: the largest batch of lead windows (first chunks; but those `compile_leads`
    # compiles) and of the tail windows shorter than a regular window decoded at once (0 = 16; at
    # most max_batch). Such first chunks of a burst queue in parts of this many, one after another
    # (codec_worker/codec.py: LEAD_MAX_BATCH).
    lead_batch: int = 0
    # Windows per codec call inside a decode: -1 = by device (16 GPU, 4 CPU), 0 = a whole batch
    # (codec_worker/codec.py: a window's bits then depend on its batch bucket).
    call_batch: int = -1
    gather_ms: float = 30.0  # longest a window waits to share a decode call
    # GPU only: cuDNN times its algorithms for each convolution shape at its first call and keeps
    # the fastest, instead of its heuristic's pick. auto: for the codec graphs' shapes, in their
    # warm-up at startup, and nothing met while serving; on: also every shape first met while
    # serving (a reference clip's length in priming or encoding, eager decodes), timed in that
    # request; off: never. A shape's algorithm stays fixed for the process's life, so a window's
    # audio still does not depend on its batch (each call one shape), though another process may
    # pick another algorithm.
    cudnn_benchmark: str = "auto"  # auto | on | off
    cuda_graphs: bool = True  # GPU only: replay captured decode graphs (--disable-cuda-graph: eager)
    gpu_share: int = 0  # serve with MPS: percent of the GPU's SMs the codec_worker may use (0 = all)
    # Codec slots (programs with codec_streams: one per request being decoded); 0 = streams_for's
    # default from the gpu_worker's batch size.
    max_streams: int = 0
    # A codec stream's waiting windows decoded as one window of up to this many (the program's
    # codec_merge sizes up to it; 1 = each window alone, the default where the model chooses none:
    # each size is a graph set of its own): a stream behind, or its first audible windows sent
    # together, takes one decode instead of one round per window.
    merge: int = 1

    def streams_for(self, gpu_max_batch: int) -> int:
        """Codec slots to allocate: `max_streams`, or twice the gpu_worker's batch plus 16. A request's
        slot is freed when its end has passed the codec, after its last chunks, while the gpu_worker
        may already run a new request in its place: twice the batch covers a full turnover."""
        return self.max_streams or 2 * gpu_max_batch + 16

    def check(self) -> None:
        if self.max_streams < 0:
            raise ValueError(f"--codec-streams must be >= 0 (0 = by the batch size), got {self.max_streams}")
        if self.call_batch < -1:
            raise ValueError(f"--codec-call-batch must be -1 (by device), 0 or more, got {self.call_batch}")
        if self.cudnn_benchmark not in ("auto", "on", "off"):
            raise ValueError(f"--codec-cudnn-benchmark is auto, on or off, not {self.cudnn_benchmark!r}")
        if self.merge < 1:
            raise ValueError(f"--codec-merge must be >= 1 (1 = each window alone), got {self.merge}")
        if self.lead_batch < 0:
            raise ValueError(f"--codec-lead-batch must be >= 0 (0 = 16), got {self.lead_batch}")
        if self.max_batch < 0 or not 0 <= self.gather_ms <= 1000:
            raise ValueError("--codec-max-batch must be >= 0 and --codec-gather-ms in 0..1000")
        if not 0 <= self.gpu_share <= 100:
            raise ValueError(f"--codec-gpu-share must be a percent in 0..100 (0 = all), got {self.gpu_share}")
        if not 0.0 <= self.first_lane_room <= 1.0:
            raise ValueError(
                f"--codec-first-lane-room is a share of the capacity in [0, 1], got {self.first_lane_room}"
            )


class ServeConfig(msgspec.Struct, kw_only=True):
    """One deployment: what every process shares, and each kind of process's own settings."""

    model: str = ""  # "" = the registry's default model (`voxpipe models` marks it)
    # gpu_worker: "cpu", "cuda", "cuda:N"; auto = cuda if available. serve with --gpu-workers N:
    # one device, or a comma-separated list of N (auto/cuda → cuda:i per pair)
    device: str = "auto"
    load_format: str = "auto"  # auto (real weights) | dummy (random weights of the real shape)
    weights: str = ""  # LM checkpoint: Hugging Face id or local directory ("" = the model's default)
    codec_weights: str = ""  # codec checkpoint, likewise
    # serve: gpu_worker + codec_worker pairs to start; gateway: how many of each /ready expects
    gpu_workers: int = 1
    zmq_curve_dir: str = ""  # every process: CURVE keys for tcp:// sockets (`voxpipe keys DIR`)
    # Accept tcp:// peers without CURVE where addresses reach beyond this host (a trusted network);
    # without it such a process refuses to start with no keys (common.ipc.secure_sockets).
    zmq_insecure: bool = False
    log_level: str = "INFO"
    # CPU threads of each process's compute (torch, OpenMP, MKL); 0 = by role and host (common/threads.py)
    threads: int = 0
    mps: str = "off"  # serve: off | on | auto (CUDA MPS for the GPU processes, see common/mps.py)
    addresses: Addresses | None = None
    run_dir: str = ""
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    tokenizer: TokenizerSettings = msgspec.field(default_factory=TokenizerSettings)
    gpu: GpuWorkerSettings = msgspec.field(default_factory=GpuWorkerSettings)
    codec: CodecSettings = msgspec.field(default_factory=CodecSettings)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return msgspec.json.decode(text, type=cls)

    def check(self) -> None:
        """Every setting that needs no model or file to check (`voxpipe serve`)."""
        if self.gpu_workers < 1:
            raise ValueError("--gpu-workers must be at least 1")
        if self.threads < 0:
            raise ValueError("--threads must be 0 (by role and host) or a positive count")
        for spec in (self.device, self.codec.device):
            n = len([p for p in spec.split(",") if p.strip()])
            if n > 1 and n != self.gpu_workers:
                raise ValueError(
                    f"--device/--codec-device list {n} devices but --gpu-workers is {self.gpu_workers}"
                )
        if self.codec.gpu_share and self.mps == "off":
            raise ValueError("--codec-gpu-share caps the codec's SMs under MPS: it needs --mps on or auto")
        for group in (self.gateway, self.tokenizer, self.gpu, self.codec):
            group.check()


def resolve_device(device: str) -> str:
    """`auto` → cuda when torch sees a GPU, else cpu; `cuda:N` also becomes this process's current
    device, so the streams that CUDA graphs are captured on, and every allocation made without a
    device, are on that GPU (capturing for cuda:1 from cuda:0's stream fails: seen on two H200s).
    Imports torch lazily (GPU-side callers only)."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)
        return device
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pair_devices(spec: str, n: int, cuda_available: Callable[[], bool] | None = None) -> list[str]:
    """The device of each of `n` gpu_worker/codec_worker pairs from `--device` (or
    `--codec-device`): a list of n, or one device for all (auto and cuda: `cuda:i` for pair i when
    there is a GPU, else cpu; auto stays auto when n == 1). Raises ValueError on a list of another
    length."""
    parts = [p.strip() for p in spec.split(",") if p.strip()] or ["auto"]
    if len(parts) == n:
        return parts
    if len(parts) != 1:
        raise ValueError(f"--device/--codec-device lists {len(parts)} devices for {n} gpu workers")
    dev = parts[0]
    if n == 1 or dev not in ("auto", "cuda"):
        return [dev] * n
    if dev == "auto":
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available
        if not cuda_available():
            return ["cpu"] * n
    return [f"cuda:{i}" for i in range(n)]


def check_model_settings(cfg: ServeConfig, spec: Mapping[str, Any]) -> None:
    """Settings the served model cannot honour: raises ValueError naming the flag."""
    wanted = spec.get("constrained", False) if cfg.gateway.constrained is None else cfg.gateway.constrained
    if wanted and not spec.get("constrainable", False):
        raise ValueError(f"--constrained: {spec['name']} has no constrained sampling mode")


def program_kwargs(cfg: ServeConfig) -> dict:
    """The keyword arguments every process builds its program with."""
    return dict(
        load_format=cfg.load_format,
        weights=cfg.weights or None,
        codec_weights=cfg.codec_weights or None,
        codec_dtype=cfg.codec.dtype,
    )
