"""Prometheus metrics of one gateway, served as text by `GET /metrics`.

Two sources: what the gateway measures itself (time to first audio, gaps between chunks, request
outcomes, requests in flight), and what the workers report in their heartbeats (`ProcStatus.metrics`:
KV pages, batch size, queue, token and step counters), exported at scrape time with a `process`
label, one series per worker that was heard from in the last second (several gpu_workers may share
one gateway; sum them in queries). Each app gets its own `CollectorRegistry`, so tests can build
several apps in one process.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.loop_lag import LoopLag
from gateway.admission import Admission
from gateway.procs import ProcessTable

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENDPOINTS = ("generate", "speech", "websocket")
# ok: complete audio; client_error: 4xx; server_error: 5xx, or a stream broken by a failure;
# cancelled: the client went away first; rejected: refused by admission (503 with Retry-After).
OUTCOMES = ("ok", "client_error", "server_error", "cancelled", "rejected")

# Heartbeat key → help text. Keys ending in _total are counters (but those in CAPACITIES); unknown
# keys export as gauges.
WORKER_METRICS = {
    "active_streams": "Requests running on the worker, each holding a slot and KV pages.",
    "queue_depth": "Prompts waiting on the worker for a slot or KV pages.",
    "kv_pages_used": "KV cache pages held by running requests (reserved for their whole budget).",
    "kv_pages_total": "KV cache pages the worker can hand out.",
    "decode_batch_size": "Requests in the worker's latest step.",
    "streams_sitting_out": "Streams far ahead of their listeners left out of a step (over the budget), averaged.",
    "generated_tokens_total": "Tokens sampled by the worker, all requests.",
    "steps_total": "Engine steps the worker has run.",
    "stream_capacity": "Concurrent streams the gpu_worker keeps real time by its fitted step cost (--capacity-headroom).",
    "life_context": "Tokens of context the running streams attend over, each averaged over its whole life.",
    "step_cost_fixed_ms": "A step's fixed time in the worker's fitted cost model (admission: stream_capacity).",
    "step_cost_token_us": "A step's time per token it computes (decode row or prompt token), fitted.",
    "step_cost_kcontext_us": "A step's time per thousand tokens of context its decode rows attend over, fitted.",
    "step_cost_prompt_ms": "A step's time per prompt it prefills, beyond the prompt's tokens and group, fitted.",
    "step_cost_group_ms": "A step's time per group of prompts prefilled together (a lane or batched graph), fitted.",
    "row_period_ms": "Recent time between engine steps: what a stream in every step waits for its next row.",
    "step_host_ms": "Host work per engine step (admit, layout, launch, consume), averaged.",
    "step_wait_ms": "Time per engine step spent waiting for the GPU to finish the previous one, averaged.",
    "step_gpu_forward_ms": "Device time of an engine step's forward pass (prefill and decode graphs), averaged.",
    "step_gpu_ms": "Device time of an engine step, forward pass and sampling, averaged.",
    "step_gpu_idle_ms": "Time per engine step the device waited for the host to launch it, averaged.",
    "step_launch_ms": "Host time to schedule and launch an engine step that starts no prompt, averaged.",
    "step_launch_prompt_ms": "Host time to schedule and launch an engine step that starts prompts, averaged.",
    "late_margin_ms": "With --late-launch: how long before the step in flight ends the next one is launched.",
    "step_hold_ms": "With --late-launch: time per engine step the worker held the next step back, averaged.",
    "prompts_started_total": "Prompts the worker's steps started (prefilled).",
    "steps_borrowing_total": "Steps whose prompts ran past the step budget on the playing streams' spare audio (--lead-borrow).",
    "steps_withholding_total": "Steps that left prompts waiting for step time the playing streams could not spare (their next chunks' promises).",
    "admission_stopped_by_batch_total": "Steps that left prompts waiting because the batch or the sampling slots were full.",
    "admission_stopped_by_cap_total": "Steps that left prompts waiting at the cap on prompts a step (--max-prefills, the prefill graphs).",
    "admission_stopped_by_rows_total": "Steps that left prompts waiting at the cap on prompt rows a step (--max-prefill-rows).",
    "admission_stopped_by_room_total": "Steps that left prompts waiting because the fitted step cost left no more room beside the running streams.",
    "admission_stopped_by_graphs_total": "Steps that left prompts waiting because the runner's graphs take no more prompts together.",
    "admission_stopped_by_pages_total": "Steps that left prompts waiting for KV pages.",
    "slow_steps_total": "Engine steps that took longer than 40 ms, wall time (the gpu_worker logs each one's parts, at most one line a second).",
    "codec_calls_total": "Codec decode passes (one burst of graph replays each: urgent windows, then the gathered rest).",
    "codec_windows_total": "Codec windows decoded.",
    "codec_busy_seconds_total": "Seconds the codec worker spent decoding.",
}

# 85 ms is one 2048-sample chunk at 24 kHz: gaps above it mean slower than real time.
TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
BEHIND_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.085, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class WorkerCollector:
    """Turns the workers' latest heartbeat metrics into Prometheus families at scrape time."""

    def __init__(self, procs: ProcessTable, admission: Admission | None = None) -> None:
        self.procs = procs

    def describe(self) -> list[Metric]:
        return []  # the families depend on what the workers report

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name, role, metrics in sorted(self.procs.fresh_metrics()):
            for key, value in metrics.items():
                family = families.get(key)
                if family is None:
                    family = families[key] = _family(key)
                family.add_metric([name, role], float(value))
        yield from families.values()


# Keys named *_total that are a capacity (a level that may go down, e.g. after a restart with a
# smaller cache), not a count of events: gauges.
CAPACITIES = frozenset({"kv_pages_total"})


def _family(key: str) -> GaugeMetricFamily | CounterMetricFamily:
    name = "voxpipe_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
    doc = WORKER_METRICS.get(key, f"{key}, as the worker reports it.")
    if name.endswith("_total") and key not in CAPACITIES:
        return CounterMetricFamily(name[: -len("_total")], doc, labels=["process", "role"])
    return GaugeMetricFamily(name, doc, labels=["process", "role"])


class GatewayMetrics:
    """The gateway's registry and the instruments the handlers update."""

    def __init__(self, procs: ProcessTable, admission: Admission | None = None) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_audio = Histogram(
            "voxpipe_time_to_first_audio_seconds",
            "From a request's arrival to its first audio leaving the gateway.",
            buckets=TTFA_BUCKETS,
            registry=self.registry,
        )
        self.inter_chunk_gap = Histogram(
            "voxpipe_inter_chunk_gap_seconds",
            "Between consecutive audio chunks of one request, as they leave the gateway.",
            buckets=GAP_BUCKETS,
            registry=self.registry,
        )
        self.stream_behind = Histogram(
            "voxpipe_stream_behind_seconds",
            "Streamed requests (chunked audio or SSE) that ended complete and whose audio fell behind "
            "playback at the gateway: how far the furthest chunk came after the audio before it had "
            "played out, counted from the first chunk. Its count is the streams a listener heard stall "
            "for a cause on the server's side.",
            buckets=BEHIND_BUCKETS,
            registry=self.registry,
        )
        self.text_to_first_audio = Histogram(
            "voxpipe_websocket_text_to_first_audio_seconds",
            "WebSocket sessions: from the first text of an utterance (after the session opens or a "
            "clear) to its first audio leaving the gateway.",
            buckets=TTFA_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "voxpipe_requests",
            "Speech requests by endpoint and outcome (ok, client_error, server_error, cancelled).",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "voxpipe_http_requests_in_flight",
            "Speech requests the gateway is answering now.",
            ["endpoint"],
            registry=self.registry,
        )
        for endpoint in ENDPOINTS:  # every series exists from the start, at 0
            self.in_flight.labels(endpoint)
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.rejected = Counter(
            "voxpipe_rejected_requests",
            "Requests refused by admission (503 with Retry-After), by reason (queue_full, queue_timeout).",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("queue_full", "queue_timeout"):
            self.rejected.labels(reason)
        self.registry.register(WorkerCollector(procs))
        if admission is not None:
            self._watch(admission)
        lag = Histogram(
            "voxpipe_gateway_loop_lag_seconds",
            "How much later than due the gateway's event loop ran a timer (sampled every 20 ms): "
            "its longest stretches of work, which every request and chunk behind them waits out.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = LoopLag(observe=lag.observe)  # run by the pipeline while it serves
        Gauge(
            "voxpipe_gateway_loop_lag_max_seconds",
            "The largest lag of the gateway's event loop over the last 10 s.",
            registry=self.registry,
        ).set_function(self.loop_lag.max_s)

    def _watch(self, admission: Admission) -> None:
        """Admission's state, read at scrape time."""
        gauges = (
            (
                "voxpipe_admission_queue_length",
                "Requests waiting for a stream (--max-queue bounds it).",
                lambda: admission.queue_length,
            ),
            ("voxpipe_admitted_streams", "Requests admitted and not finished.", lambda: admission.active),
            (
                "voxpipe_stream_limit",
                "Streams admitted at once (-1: no gpu_worker has reported yet).",
                lambda: -1 if (n := admission.limit()) is None else n,
            ),
        )
        for name, doc, fn in gauges:
            Gauge(name, doc, registry=self.registry).set_function(fn)

    def watch_registry(self, size: Callable[[], int]) -> None:
        """The pipeline's request registry, read at scrape time: a generation no handler waits on
        any more and still counted here is a leak."""
        Gauge(
            "voxpipe_gateway_requests_registered",
            "Generations the gateway routes worker events for (its registry of requests in flight).",
            registry=self.registry,
        ).set_function(size)

    def finished(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def outcome_of(status: int) -> str:
    """The outcome label of a request answered with HTTP `status`."""
    if status == 499:
        return "cancelled"
    if 400 <= status < 500:
        return "client_error"
    return "server_error" if status >= 500 else "ok"
