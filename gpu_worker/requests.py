"""What the engine keeps per request, and the limits it runs under (gpu_worker/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.messages import SamplingParams


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
    # First audio of a request: "reference" waits for the first full window (28 Orpheus tokens);
    # "adaptive" sends a short lead window (the program's `detok_lead`) as soon as the measured
    # step rate lets the next window arrive before the lead has played out; "fastest" always
    # sends the smallest lead (deterministic: for tests); "progressive" sends each first frame as a
    # tail window as soon as it exists, until the stream is far enough ahead (gpu_worker/windows.py).
    first_chunk: str = "adaptive"
    # Admission (gpu_worker.pacing.StepClock.capacity): the load whose step, every stream in it at
    # its life-average context, takes at most this share of a row's playback time by the fitted
    # step cost (gpu_worker.pacing.StepCost)...
    capacity_headroom: float = 0.92
    # ... and until that is fitted, the largest load whose step takes at most this share; also the
    # step budget that streams sitting out keep steps under (gpu_worker.pacing.SitOut).
    realtime_headroom: float = 0.88
    # Streams with this much audio in hand (seconds) may sit out steps that run over the budget
    # (gpu_worker.pacing.SitOut), which shortens the steps of those with less; 0 = never.
    sit_out_lead_s: float = 0.5
    # Keys/values: "auto" stores them in the model's dtype; "fp8" in float8 e4m3 with scale 1
    # (attention reads half the bytes; queries and outputs stay in the model's dtype).
    kv_cache_dtype: str = "auto"
    # The decode steps' attention: "flashinfer", "xqa" (gpu_worker.xqa_backend) or "auto" (xqa for
    # an fp8 cache on Hopper). Prefill rows always run on FlashInfer.
    decode_attention: str = "auto"
    # FlashInfer's decode kernel: on tensor cores (its FA2 prefill kernel; 0.85-0.89x the time of the
    # CUDA-core kernel for Orpheus-3B's bf16 cache on the H200), or the CUDA-core decode kernel
    # (bench/attention_kv.py compares them; with an fp8 cache it is not measured yet).
    decode_tensor_cores: bool = True
    # A step's first new prompt runs in one graph with its decode rows (gpu_worker.graphs, mixed
    # graphs) when the program allows it; False: in a prefill graph of its own.
    mixed_prefill: bool = True


@dataclass
class Request:
    rid: str
    prompt: np.ndarray  # [R, C] int64
    sp: SamplingParams
    arrival: float
    budget: int  # total tokens allowed, prompt included
    urgent: bool = False  # a later segment of a stream already playing: admitted before new ones
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # sampling-state slot while running
    n_ctx: int = 0  # rows in the KV cache once the launched steps complete
    n_launched: int = 0  # sampling steps launched
    n_gen: int = 0  # sampled rows consumed
    done: bool = False  # finished (its results from steps still in flight are dropped)
    # rows consumed (stop excluded): the codebook-0 id when C = 1, else the whole row as a list
    generated: list = field(default_factory=list)
    audio: np.ndarray | None = None  # [budget, C] int32 audio rows
    n_audio: int = 0
    n_chunks: int = 0
    first_window: int = 0  # regular windows below this are covered by the lead or tail windows sent
    switched: bool = False  # progressive mode: tail windows are over, regular ones from now on
    t_first: float = 0.0  # monotonic time its first chunk left (its listener's playback starts)
    sent_s: float = 0.0  # seconds of audio in the chunks sent so far
    admitted_at: float = 0.0
    gen_budget: int = 0  # rows it may generate: budget less the prompt

    def __post_init__(self) -> None:
        self.gen_budget = self.budget - len(self.prompt)
