"""`voxpipe tap`: subscribe to the processes' taps and print request timelines as JSON lines.

Every process started with `--tap ADDR` (VOXPIPE_TAP; `voxpipe serve` gives each one, in its run
directory) mirrors what it sends there as [TapHeader, message] (`common.ipc.Tap`). This decodes
each message with the real structs (`TapMsg`) and turns it into timeline events, one JSON object
per line: `{"time", "ms", "rid", "stage", "proc", ...detail}`, `ms` counting from the request's
arrival at the gateway. The stages of one request, in order:

    http_received (gateway, once admitted), received, dispatched (gateway) · prompt_built (tokenizer) · admitted, first_token (gpu_worker)
    · first_chunk_ready (gpu_worker) · first_chunk_decoded (codec) · first_byte_sent (gateway)
    · finished (gpu_worker) · codec_finished (codec) · response_done (gateway)

plus failed, abort, and (with --all-chunks) chunk_ready / chunk_decoded for every later chunk; a
chunk's `*_ready` event carries its listener's slack as the gpu_worker stamped it (`slack_ms`: audio
sent before it less audio played since the first chunk left; 0 for a first chunk, or one late) and
its `tail_rows` (> 0: a progressive tail window, its stream not yet on regular windows). The
gpu_worker also publishes one `step` event a step, under request id "" (gpu_worker/stages.py: its
batch, the prompts it started, where its time went); `--rid` leaves them out, `--stage step` keeps
them alone.
Events from several processes are held for `--reorder-ms` and printed in time order.

The state file (`state_path`) is how `voxpipe tap` without --connect finds a local `voxpipe serve`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq

from common.messages import (
    Abort,
    AudioChunks,
    DetokBatch,
    FinishReason,
    GenerateRequest,
    Prompt,
    RequestError,
    StageEvent,
    TapHeader,
    TapMsg,
)

Event = dict[str, Any]

# --- state file: where a local `voxpipe serve` keeps its taps ---------------------------------------


def state_dir() -> str:
    """$XDG_RUNTIME_DIR/voxpipe, else /tmp/voxpipe-$UID (private to this user)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(runtime, "voxpipe") if runtime else f"/tmp/voxpipe-{os.getuid()}"


def state_path(port: int) -> str:
    return os.path.join(state_dir(), f"serve-{port}.json")


def write_state(port: int, url: str, run_dir: str, model: str, taps: dict[str, str]) -> str:
    os.makedirs(state_dir(), mode=0o700, exist_ok=True)
    path = state_path(port)
    body = {"pid": os.getpid(), "port": port, "url": url, "run_dir": run_dir, "model": model, "taps": taps}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def remove_state(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_servers() -> list[dict[str, Any]]:
    """Every running `voxpipe serve` of this user (state files of dead ones are ignored)."""
    out = []
    try:
        names = sorted(os.listdir(state_dir()))
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("serve-") and name.endswith(".json"):
            try:
                with open(os.path.join(state_dir(), name)) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                continue
            if _alive(int(state.get("pid", 0))):
                out.append(state)
    return out


def find_taps(port: int | None = None) -> list[str]:
    servers = [s for s in local_servers() if port is None or s["port"] == port]
    if not servers:
        where = f" on port {port}" if port is not None else ""
        raise ValueError(
            f"no running `voxpipe serve`{where} found in {state_dir()}; start one, or pass "
            "--connect ADDR (a process's --tap / VOXPIPE_TAP address, e.g. tcp://gateway:5570)"
        )
    if len(servers) > 1:
        ports = ", ".join(str(s["port"]) for s in servers)
        raise ValueError(f"several `voxpipe serve` are running (ports {ports}); pass --port to pick one")
    return list(servers[0]["taps"].values())


# --- messages → timeline events -------------------------------------------------------------------


def events_of(header: TapHeader, msg: Any) -> list[Event]:
    """Timeline events for one mirrored message (one per request it concerns)."""
    t, proc = header.time, header.proc

    def ev(rid: str, stage: str, when: float = t, detail: dict[str, Any] | None = None, **kw: Any) -> Event:
        base = {"time": when, "rid": rid, "stage": stage, "proc": proc}
        # Details never overwrite the fields every line has (a StageEvent's come off the wire).
        return base | {k: v for k, v in (detail or kw).items() if k not in base and k != "ms"}

    match msg:
        case GenerateRequest():
            return [
                ev(msg.rid, "received", msg.arrival or t, chars=len(msg.text), model_kwargs=msg.model_kwargs),
                ev(msg.rid, "dispatched", worker=header.peer) if header.peer else ev(msg.rid, "dispatched"),
            ]
        case Prompt() if header.peer:  # the gateway handing it to a gpu_worker with free capacity
            return [ev(msg.rid, "routed", worker=header.peer)]
        case Prompt():
            return [ev(msg.rid, "prompt_built", rows=msg.n_rows, arrival=msg.arrival)]
        case RequestError():
            return [ev(msg.rid, "failed", status=msg.status, message=msg.message)]
        case Abort():
            return [ev(rid, "abort") for rid in msg.rids]
        case StageEvent():
            return [ev(msg.rid, msg.stage, msg.time or t, detail=msg.detail)]
        case DetokBatch():
            out = [
                ev(c.rid, "first_chunk_ready" if c.index == 0 else "chunk_ready", index=c.index,
                   slack_ms=round(c.slack_ms, 2), tail_rows=c.tail_rows)
                for c in msg.chunks
            ]  # fmt: skip
            return out + [_finished(ev, f, "finished") for f in msg.finished]
        case AudioChunks():
            out = [
                ev(
                    c.rid,
                    "first_chunk_decoded" if c.index == 0 else "chunk_decoded",
                    index=c.index,
                    samples=len(c.pcm) // 2,
                )
                for c in msg.chunks
            ]
            return out + [_finished(ev, f, "codec_finished") for f in msg.finished]
        case _:
            return []  # ProcStatus and anything without a request


def _finished(ev: Any, f: Any, stage: str) -> Event:
    extra = {"message": f.message, "status": f.status} if f.reason == FinishReason.ERROR else {}
    return ev(
        f.rid,
        stage,
        reason=FinishReason(f.reason).name.lower(),
        tokens=f.n_tokens,
        chunks=f.n_chunks,
        **extra,
    )


_ARRIVALS = ("http_received", "received")


class Timeline:
    """Filters events, adds `ms` since arrival, and prints them in time order after a short hold
    (events of one request come from several processes over several sockets)."""

    def __init__(
        self,
        rids: set[str],
        stages: set[str],
        all_chunks: bool,
        reorder_s: float,
        out: Any = sys.stdout,
    ) -> None:
        self.rids, self.stages, self.all_chunks, self.reorder_s, self.out = (
            rids,
            stages,
            all_chunks,
            reorder_s,
            out,
        )
        # rid → (arrival, whether it is the HTTP arrival) (bounded)
        self._arrival: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        self._heap: list[tuple[float, int, Event]] = []
        self._n = 0

    def add(self, events: list[Event]) -> None:
        now = time.monotonic()
        for e in events:
            arrival = e.pop("arrival", 0.0) or (e["time"] if e["stage"] in _ARRIVALS else 0.0)
            # The HTTP arrival when seen (before the admission wait), else the segment's submission
            # (a later `received` of an id whose arrival was a submission: the id came back).
            if arrival and (e["stage"] in _ARRIVALS or e["rid"] not in self._arrival):
                seen = self._arrival.get(e["rid"])
                if e["stage"] != "received" or seen is None or not seen[1]:
                    self._arrival[e["rid"]] = (arrival, e["stage"] == "http_received")
                while len(self._arrival) > 100_000:
                    self._arrival.popitem(last=False)
            if self.rids and e["rid"] not in self.rids:
                continue
            if self.stages and e["stage"] not in self.stages:
                continue
            if not self.all_chunks and e["stage"] in ("chunk_ready", "chunk_decoded"):
                continue
            self._n += 1
            heapq.heappush(self._heap, (e["time"], self._n, {"_held": now, **e}))

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        while self._heap and (force or now - self._heap[0][2]["_held"] >= self.reorder_s):
            _, _, e = heapq.heappop(self._heap)
            del e["_held"]
            if e["rid"] in self._arrival:
                e = {"time": e["time"], "ms": round(1000 * (e["time"] - self._arrival[e["rid"]][0]), 3), **e}
            print(json.dumps(e), file=self.out, flush=True)


# --- the command ------------------------------------------------------------------------------------


def add_tap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect",
        action="append",
        default=[],
        metavar="ADDR",
        help="a process's tap address (repeat for several); default: every tap of the local `voxpipe serve`",
    )
    p.add_argument("--port", type=int, default=None, help="which local `voxpipe serve` (when several run)")
    p.add_argument(
        "--zmq-curve-dir",
        default=os.environ.get("VOXPIPE_ZMQ_CURVE_DIR", ""),
        help="the deployment's CURVE keys, for taps on tcp:// [env VOXPIPE_ZMQ_CURVE_DIR]",
    )
    p.add_argument("--rid", action="append", default=[], help="only this request id (repeatable)")
    p.add_argument("--stage", action="append", default=[], help="only this stage (repeatable)")
    p.add_argument("--all-chunks", action="store_true", help="an event for every chunk, not only the first")
    p.add_argument(
        "--reorder-ms", type=float, default=100.0, help="hold events this long to print them in order"
    )
    p.add_argument(
        "--seconds", type=float, default=0.0, help="exit after this long (0: run until interrupted)"
    )


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM like Ctrl-C: print what is held, then exit


def run_tap(args: argparse.Namespace) -> int:
    addrs = args.connect or find_taps(args.port)
    signal.signal(signal.SIGTERM, _interrupt)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if args.zmq_curve_dir and any(a.startswith("tcp://") for a in addrs):
        from common import curve

        curve.use_curve(args.zmq_curve_dir)
        curve.apply(ctx, sock, bind=False)  # taps on tcp:// admit only the deployment's keys
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for addr in addrs:
        sock.connect(addr)
    dec = msgspec.msgpack.Decoder(TapMsg)
    hdec = msgspec.msgpack.Decoder(TapHeader)
    timeline = Timeline(set(args.rid), set(args.stage), args.all_chunks, args.reorder_ms / 1000)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    connected = 0
    deadline = time.monotonic() + args.seconds if args.seconds > 0 else None
    print(f"tap: subscribing to {len(addrs)} tap(s): {' '.join(addrs)}", file=sys.stderr, flush=True)
    try:
        while deadline is None or time.monotonic() < deadline:
            for s, _ in poller.poll(int(max(10, args.reorder_ms / 2))):
                if s is monitor:
                    monitor.recv_multipart()
                    connected += 1
                    print(f"tap: connected {connected}/{len(addrs)}", file=sys.stderr, flush=True)
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    continue
                try:
                    header, msg = hdec.decode(frames[0]), dec.decode(frames[1])
                    timeline.add(events_of(header, msg))
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    print(f"tap: undecodable message ({e})", file=sys.stderr, flush=True)
            timeline.flush()
    except KeyboardInterrupt:
        pass
    finally:
        timeline.flush(force=True)
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    return 0
