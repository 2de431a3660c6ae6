"""Where a request's time goes under load, from `voxpipe tap --all-chunks` output (JSON lines).

    voxpipe tap --all-chunks --seconds 10 > tap.jsonl      # while a load runs
    voxpipe bench tap-stats tap.jsonl [--out stats.json]

For requests whose arrival the tap saw, the first audio split by stage (gateway → prompt built →
admitted → first token → first chunk ready → decoded → first byte sent), as p50/p90/p99 ms, and
each stage's median among the slowest 5 % of them (where a tail's time goes); for
every chunk, the codec's part (ready at the gpu_worker → decoded at the codec_worker), also by the
chunk's place in its request, and for second chunks against the slack they left with; the gaps
between a request's consecutive chunks leaving the gpu_worker; the chunks that fell behind their
listener and where (`chunks_behind`); given the client's own TTFA per request id (bench/ttfa_http.py
--tap-level), what the client saw beyond the server's part; from the gpu_worker's step events
(gpu_worker/stages.py), where its steps' time went (`steps`): the steps that start prompts and those
that do not, and those after which prompts still wait (a burst's admission), each part's p50/p90/max
and mean in ms; when each stage happened over the requests, from the first one's arrival
(`stage_timeline_ms`: a burst's critical path, as when its handlers started and its last prompt was
admitted; given the burst's size, over its first wave alone: a closed loop's next requests come
seconds later), and how many rows the first chunks held (`first_chunk_rows`); the requests in waves
(`waves`: split where arrivals pause, as a closed loop's burst and the next requests its clients send
as their streams end), each with its admission's span, its steps and its streams' tail windows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import Counter, defaultdict

# The tap's chunk stages, and which time of a chunk each records
CHUNK_STAGES = {"chunk_ready": "ready", "first_chunk_ready": "ready", "chunk_decoded": "decoded",
                "first_chunk_decoded": "decoded"}  # fmt: skip
TAIL_SHARE = 0.05  # `first_audio_tail_ms`: the slowest requests' share
# A gpu_worker step event's parts (ms), as `steps` reports them
STEP_PARTS = ("loop", "wall", "gpu", "schedule", "launch", "wait", "process")
WAVE_GAP_MS = 1000.0  # `waves`: arrivals further apart than this start a new wave

FIRST = ("received", "prompt_built", "admitted", "first_token", "first_chunk_ready", "first_chunk_decoded",
         "first_byte_sent")  # fmt: skip


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)

    def at(q: float) -> float:
        return round(v[min(len(v) - 1, int(q / 100 * len(v)))], 2)

    return {"n": len(v), "p50": at(50), "p90": at(90), "p99": at(99), "max": round(v[-1], 2)}


def _tail(whole: list[dict[str, float]]) -> dict[str, float]:
    """The requests whose first audio took longest (the slowest TAIL_SHARE, at least one): how
    many, and each stage's median among them, so that a tail (a burst's, say) shows which stage
    holds it: the stages' percentiles over all requests do not say which requests they come from."""
    if not whole:
        return {}
    slowest = sorted(whole, key=lambda s: s[FIRST[-1]] - s[FIRST[0]])
    tail = slowest[-max(1, math.ceil(TAIL_SHARE * len(slowest))) :]

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    out: dict[str, float] = {"n": len(tail)}
    if all("http_received" in s for s in tail):  # the HTTP arrival: the wait for admission before it
        out["http_received->received"] = median([s["received"] - s["http_received"] for s in tail])
    for a, b in zip(FIRST, FIRST[1:], strict=False):
        out[f"{a}->{b}"] = median([s[b] - s[a] for s in tail])
    out["total"] = median([s[FIRST[-1]] - s[FIRST[0]] for s in tail])
    return out


def _timeline(whole: list[dict[str, float]]) -> dict:
    """Each first-audio stage's time over the requests that have them all, ms after the earliest
    arrival among them (the HTTP handler's where recorded): the first, p50, p90 and last request to
    reach it."""
    if not whole:
        return {}
    stages = ("http_received", *FIRST) if all("http_received" in s for s in whole) else FIRST
    t0 = min(s[stages[0]] for s in whole)
    out = {}
    for stage in stages:
        times = sorted(s[stage] - t0 for s in whole)
        pct = _pct(times)
        out[stage] = {
            "first": round(times[0], 1),
            "p50": pct["p50"],
            "p90": pct["p90"],
            "last": round(times[-1], 1),
        }
    return out


def _behind(chunks: dict[str, dict[int, dict[str, float]]]) -> dict:
    """The chunks that fell behind their listener, by the gpu_worker's clock (it starts when a
    request's first audible chunk leaves the gpu_worker, before the listener's does, so it errs
    towards behind): each chunk's `slack_ms` is the listener's audio in hand when it left the
    gpu_worker. Counted: a request's chunks that left after its first audible one (a decoded chunk
    with samples; the windows that leave with it are stamped otherwise). Behind at the gpu_worker:
    it left with no audio in hand (stamped 0: the LM's steps made it too late); at the codec: it left
    in time, and the codec took longer than the slack it had. Each with when in its stream it came
    (ms after the first audible chunk left, or the first the recording saw of a request it caught
    midway), how many of them are tail windows (a progressive stream's first frames, where the
    recording has `tail_rows`) and, at the codec, the codec's time."""
    counted = 0
    slack: list[float] = []
    gpu: list[float] = []
    codec: list[tuple[float, float]] = []  # (since the first audible chunk, codec ms)
    tails = {"at_gpu_worker": 0, "at_codec": 0}  # of those, tail windows
    requests: set[str] = set()
    for rid, by_index in chunks.items():
        audible = [c["ready"] for c in by_index.values() if c.get("samples", 1) > 0 and "ready" in c]
        if not audible:
            continue
        t0 = min(audible)
        for c in by_index.values():
            if "ready" not in c or "slack_ms" not in c or c["ready"] <= t0:
                continue
            counted += 1
            slack.append(c["slack_ms"])
            if c["slack_ms"] <= 0.0:
                gpu.append(c["ready"] - t0)
                requests.add(rid)
                tails["at_gpu_worker"] += c.get("tail_rows", 0) > 0
            elif "decoded" in c and c["decoded"] - c["ready"] > c["slack_ms"]:
                codec.append((c["ready"] - t0, c["decoded"] - c["ready"]))
                requests.add(rid)
                tails["at_codec"] += c.get("tail_rows", 0) > 0
    if not counted:
        return {}
    return {
        "counted": counted,
        "requests_behind": len(requests),
        "at_gpu_worker": len(gpu),
        "at_codec": len(codec),
        "tail_windows_at_gpu_worker": tails["at_gpu_worker"],
        "tail_windows_at_codec": tails["at_codec"],
        "slack_ms": _pct(slack),
        "at_gpu_worker_since_first_ms": _pct(gpu),
        "at_codec_since_first_ms": _pct([t for t, _ in codec]),
        "at_codec_codec_ms": _pct([ms for _, ms in codec]),
    }


def _second(chunks: dict[str, dict[int, dict[str, float]]]) -> dict:
    """A request's second chunk (index 1): a progressive stream's tightest deadline, whose trip the
    first-chunk decision allowed (gpu_worker/windows.py `DELIVERY_S`, `LANE_DELIVERY_S`). Its
    `slack_ms` (the listener's audio in hand when it left the gpu_worker), the codec's time on it,
    and what the slack left past the codec (`spare_ms`; the gateway's part comes out of it): the
    trip it needed, against the one allowed."""
    slack, codec, spare = [], [], []
    for by_index in chunks.values():
        c = by_index.get(1, {})
        if "ready" in c and "decoded" in c and "slack_ms" in c:
            took = c["decoded"] - c["ready"]
            slack.append(c["slack_ms"])
            codec.append(took)
            spare.append(c["slack_ms"] - took)
    if not slack:
        return {}
    return {"slack_ms": _pct(slack), "codec_ms": _pct(codec), "spare_ms": _pct(spare),
            "spare_ms_min": round(min(spare), 2)}  # fmt: skip


def _opener(path: str):
    """A tap file is gzipped where its name ends in .gz, plain JSON lines otherwise."""
    return gzip.open if path.endswith(".gz") else open


def write(path: str, data: bytes) -> None:
    """A tap's JSON lines (`voxpipe tap`'s output) into `path`, as `read` reads them back."""
    with _opener(path)(path, "wb") as f:
        f.write(data)


def read(path: str) -> list[dict]:
    with _opener(path)(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def stats(
    events: list[dict],
    client_ttfa: dict[str, float] | None = None,
    client_began: dict[str, float] | None = None,
    wave: int = 0,
) -> dict:
    """The summary; with `client_ttfa` (ms by request id, as the HTTP client timed them), also what
    the client saw beyond the server's arrival (the HTTP request's, where the recording has it) → first
    byte sent (`client_minus_server_ms`); with `client_began` too (each request's start on the
    client's wall clock, s: a client on the server's host), that part split in two: from the
    client's start to the gateway's handler (`client_to_handler_ms`: connecting, sending, the
    gateway's accept and parse, its event loop's queue) and from the first byte sent to the
    client's first audio (`first_byte_to_client_ms`: the way back, the client reading it). With
    `wave` (a burst's size), the stage timeline covers the first `wave` requests to arrive: the
    burst itself, not the requests its clients send as their streams end (`timeline_requests`)."""
    by_rid: dict[str, dict[str, float]] = defaultdict(dict)
    # request id → chunk index → its times (ready at the gpu_worker, decoded) and details
    chunks: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    steps: list[dict] = []  # the gpu_worker's step events (no request's)
    for e in events:
        stage, rid, t = e["stage"], e.get("rid", ""), 1000 * e["time"]
        if stage == "step":
            steps.append(e)
            continue
        by_rid[rid].setdefault(stage, t)
        when = CHUNK_STAGES.get(stage)
        if when is not None:
            chunk = chunks[rid][e.get("index", 0)]
            chunk[when] = t
            chunk.update((key, e[key]) for key in ("slack_ms", "tail_rows", "samples") if key in e)
    out: dict = {"requests_seen": len(by_rid)}
    whole = [s for s in by_rid.values() if all(k in s for k in FIRST)]
    out["first_audio_complete"] = len(whole)
    out["first_audio_ms"] = {
        f"{a}->{b}": _pct([s[b] - s[a] for s in whole]) for a, b in zip(FIRST, FIRST[1:], strict=False)
    }
    out["first_audio_ms"]["total"] = _pct([s[FIRST[-1]] - s[FIRST[0]] for s in whole])
    out["first_audio_tail_ms"] = _tail(whole)
    if wave:  # the burst: the first requests to arrive at the gateway
        first = sorted(whole, key=lambda s: s.get("http_received", s[FIRST[0]]))[:wave]
    else:
        first = whole
    out["timeline_requests"] = len(first)
    out["stage_timeline_ms"] = _timeline(first)
    out["first_chunk_rows"] = _first_chunk_rows(chunks, chunks)
    # Recordings that have it: the HTTP arrival, before reading the body and the admission wait.
    http = [s for s in whole if "http_received" in s]
    if http:
        out["first_audio_ms"]["http_received->received"] = _pct(
            [s["received"] - s["http_received"] for s in http]
        )
        out["first_audio_ms"]["total_from_http"] = _pct([s[FIRST[-1]] - s["http_received"] for s in http])
    if client_ttfa:
        # A text spoken in several segments has its first one's stages under "<request id>/0".
        server = {rid.removesuffix("/0"): s for rid, s in by_rid.items() if all(k in s for k in FIRST)}
        out["client_minus_server_ms"] = _pct(
            [client_ttfa[rid] - (s[FIRST[-1]] - s.get("http_received", s[FIRST[0]]))
             for rid, s in server.items() if rid in client_ttfa]
        )  # fmt: skip
        if client_began:
            both = [(rid, s) for rid, s in server.items() if rid in client_ttfa and rid in client_began]
            out["client_to_handler_ms"] = _pct(
                [s.get("http_received", s[FIRST[0]]) - 1000 * client_began[rid] for rid, s in both]
            )
            out["first_byte_to_client_ms"] = _pct(
                [1000 * client_began[rid] + client_ttfa[rid] - s[FIRST[-1]] for rid, s in both]
            )
    ready = [c for by_index in chunks.values() for c in by_index.values() if "ready" in c]
    out["codec_ms_per_chunk"] = _pct([c["decoded"] - c["ready"] for c in ready if "decoded" in c])
    gaps: dict[int, list[float]] = defaultdict(list)  # chunk index -> ms since the previous chunk left
    for by_index in chunks.values():
        for i, c in by_index.items():
            before = by_index.get(i - 1, {})
            if i and "ready" in c and "ready" in before:
                gaps[min(i, 10)].append(c["ready"] - before["ready"])
    out["ready_gap_ms_by_chunk_index"] = {
        ("10+" if i == 10 else str(i)): _pct(g) for i, g in sorted(gaps.items())
    }
    codec_by_index: dict[int, list[float]] = defaultdict(list)  # chunk index -> its codec ms
    for by_index in chunks.values():
        for i, c in by_index.items():
            if "ready" in c and "decoded" in c:
                codec_by_index[min(i, 3)].append(c["decoded"] - c["ready"])
    out["codec_ms_by_chunk_index"] = {
        ("3+" if i == 3 else str(i)): _pct(v) for i, v in sorted(codec_by_index.items())
    }
    out["second_chunks"] = _second(chunks)
    out["chunks_behind"] = _behind(chunks)
    if steps:
        out["steps"] = _steps(steps)
    out["waves"] = _waves(by_rid, chunks, steps)
    return out


def _first_chunk_rows(chunks: dict[str, dict[int, dict[str, float]]], rids) -> dict[str, int]:
    """How many of the requests `rids` had a first chunk of each number of rows."""
    rows = Counter(chunks[r][0]["tail_rows"] for r in rids if "tail_rows" in chunks.get(r, {}).get(0, {}))
    return {str(k): rows[k] for k in sorted(rows)}


def _waves(
    by_rid: dict[str, dict[str, float]], chunks: dict[str, dict[int, dict[str, float]]], steps: list[dict]
) -> list[dict]:
    """The requests whose arrival the tap saw (the HTTP handler's where recorded), in waves split
    where arrivals pause for more than WAVE_GAP_MS: a closed loop's burst, then the requests its
    clients send as their streams end. For each, from its first arrival (ms): over how long its
    requests arrive and when its last one is admitted; its first audio at the server (arrival →
    first byte sent: p50, p99); its first chunks' rows; how many tail windows its streams send
    before their first regular window (`tail_windows_per_stream`: streams by count); and the gpu_worker's
    steps that leave prompts waiting from its first arrival to its last admission (how many, the
    prompts they start, how many start one, what stopped them). A wave's admission that takes
    longer than its arrivals, through steps of one prompt, is a second wave admitted slowly."""
    # A text spoken in several segments arrives once: its first one's stages under "<request id>/0",
    # the later ones' ("<request id>/<k>") submitted as each before ends.
    arrived = sorted(
        (by_rid.get(rid.removesuffix("/0"), s).get("http_received", s["received"]), rid)
        for rid, s in by_rid.items()
        if rid and "received" in s and not (rid.rpartition("/")[2].isdigit() and not rid.endswith("/0"))
    )
    waves: list[list[tuple[float, str]]] = []
    for t, rid in arrived:
        if not waves or t - waves[-1][-1][0] > WAVE_GAP_MS:
            waves.append([])
        waves[-1].append((t, rid))
    out = []
    for wave in waves:
        t0, rids = wave[0][0], [rid for _, rid in wave]
        admitted = [by_rid[r]["admitted"] for r in rids if "admitted" in by_rid[r]]
        end = max(admitted, default=t0)
        first_audio = [by_rid[r]["first_byte_sent"] - t for t, r in wave if "first_byte_sent" in by_rid[r]]
        tails: Counter = Counter()
        for r in rids:
            by_index = chunks.get(r, {})
            n = 0
            while by_index.get(n + 1, {}).get("tail_rows", 0) > 0:
                n += 1
            if by_index:
                tails[n] += 1
        waiting = [e for e in steps if e.get("waiting", 0) > 0 and e.get("batch", 0) > 0
                   and t0 <= 1000 * e["time"] <= end]  # fmt: skip
        pct = _pct(first_audio)
        out.append({
            "requests": len(wave),
            "arrivals_over_ms": round(wave[-1][0] - t0, 1),
            "admitted": len(admitted),
            "last_admitted_ms": round(end - t0, 1),
            "first_audio_ms": {k: pct[k] for k in ("p50", "p99")} if pct else {},
            "first_chunk_rows": _first_chunk_rows(chunks, rids),
            "tail_windows_per_stream": {str(k): tails[k] for k in sorted(tails)},
            "steps_with_prompts_waiting": len(waiting),
            "prompts_they_start": sum(e.get("prompts", 0) for e in waiting),
            "one_prompt_steps": sum(e.get("prompts", 0) == 1 for e in waiting),
            "stops": dict(Counter(e["stop"] for e in waiting if e.get("stop"))),
        })  # fmt: skip
    return out


def _steps(events: list[dict]) -> dict:
    """The gpu_worker's steps that launched work, in three sets: those that start prompts, those
    that do not, and those after which prompts still wait (`waiting` > 0: a burst's admission): how
    many, the prompts they start (mean, max) and each part's p50/p90/max and mean (ms); for the
    steps after which prompts wait, also what stopped their admission (`stops`: steps by
    `ADMISSION_STOPS` name) and what it withheld of the budget (`withheld_ms`)."""
    launched = [e for e in events if e.get("batch", 0) > 0]
    sets = {
        "with_prompts": [e for e in launched if e.get("prompts", 0) > 0],
        "decode_only": [e for e in launched if e.get("prompts", 0) == 0],
        "prompts_waiting": [e for e in launched if e.get("waiting", 0) > 0],
    }
    out: dict = {"launched": len(launched)}
    for name, group in sets.items():
        if not group:
            continue
        prompts = [e.get("prompts", 0) for e in group]
        row: dict = {
            "n": len(group),
            "prompts_mean": round(statistics.fmean(prompts), 2),
            "prompts_max": max(prompts),
        }
        row["batch_mean"] = round(statistics.fmean(e["batch"] for e in group), 1)
        for part in STEP_PARTS:
            values = [e[f"{part}_ms"] for e in group if f"{part}_ms" in e]
            if values:
                row[f"{part}_ms"] = {**_pct(values), "mean": round(statistics.fmean(values), 2)}
        if name == "prompts_waiting":
            row["stops"] = dict(Counter(e["stop"] for e in group if e.get("stop")))
            withheld = [e["withheld_ms"] for e in group if "withheld_ms" in e]
            if withheld:
                row["withheld_ms"] = {**_pct(withheld), "mean": round(statistics.fmean(withheld), 2)}
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", help="tap output (JSON lines, .gz too)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = stats(read(args.path))
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
