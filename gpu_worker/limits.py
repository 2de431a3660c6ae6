"""The settings the gpu_worker runs under, one default each (`DEFAULTS`): a plain container that
the worker fills from its command line (gpu_worker/worker.py `engine_limits`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineLimits:
    max_batch_size: int = 16
    max_context: int = 1200
    page_size: int = 16
    num_pages: int = 0  # 0 = room for max_batch_size full contexts
    max_prefill_rows: int = 8192  # prompt rows per step, so one step never grows unbounded
    cuda_graphs: bool = True  # GPU only: replay captured decode graphs
    min_decode_batch: int = 1  # smallest decode graph: smaller batches are padded up to it
    # FlashInfer: one KV split per request, so attention reduces in the same order at any batch
    # size (measured on the H200: without it, greedy tokens change when the batch grows).
    no_split_kv: bool = True
    # First audio of a request: "reference" waits for the first full window (`detok_interval` rows);
    # "adaptive" sends a short lead window (the program's `detok_lead`) as soon as the measured
    # step rate lets the next window arrive before the lead has played out; "fastest" always
    # sends the smallest lead (deterministic: for tests); "progressive" sends each first frame as a
    # tail window as soon as it exists, until the stream is far enough ahead (gpu_worker/windows.py).
    first_chunk: str = "adaptive"
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
    # Keys/values: "auto" stores them in the model's dtype; "fp8" in float8 e4m3 with scale 1
    # (attention reads half the bytes; queries and outputs stay in the model's dtype).
    kv_cache_dtype: str = "auto"
    # The decode steps' attention: "flashinfer", "xqa" (gpu_worker.attention.xqa) or "auto" (xqa for
    # an fp8 cache on Hopper). Prefill rows always run on FlashInfer.
    decode_attention: str = "auto"
    # FlashInfer's decode kernel: on tensor cores (its FA2 prefill kernel; 0.85-0.89x the time of the
    # CUDA-core kernel for a 3B model's bf16 cache on the H200), or the CUDA-core decode kernel
    # (bench/attention_kv.py compares them; with an fp8 cache it is not measured yet).
    decode_tensor_cores: bool = True
    # A step's first new prompt runs in one graph with its decode rows (gpu_worker.runner.graphs, mixed
    # graphs) when the program allows it; False: in a prefill graph of its own.
    mixed_prefill: bool = True


DEFAULTS = EngineLimits()
