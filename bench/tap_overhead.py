"""What a tap costs per message: `PushChannel.send` with no tap, with a tap nobody listens to, and
with a tap someone listens to; plus `publish_stage` (the gateway / gpu_worker stage events).

    python bench/tap_overhead.py [--n 50000]

Prints microseconds per call (median of 5 runs), for a small Prompt and a 16-chunk DetokBatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ipc  # noqa: E402
from common.messages import DetokBatch, DetokChunk, Prompt, SamplingParams  # noqa: E402


def messages() -> dict[str, object]:
    rows = np.arange(40, dtype="<i4").tobytes()
    chunk = np.arange(28, dtype="<i4").tobytes()
    return {
        "Prompt (40 rows)": Prompt("a" * 32, rows, 40, SamplingParams(seed=1)),
        "DetokBatch (16 chunks)": DetokBatch([DetokChunk(f"r{i:031d}", i, i, chunk) for i in range(16)]),
    }


def drain(addr: str, kind: int, stop: threading.Event) -> None:
    sock = zmq.Context.instance().socket(kind)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(addr)
    else:
        sock.bind(addr)
    while not stop.is_set():
        if sock.poll(50):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
    sock.close(linger=0)


def _once(chan: ipc.PushChannel, msg: object, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        chan.send(msg)
    return (time.perf_counter() - t0) / n * 1e6


def time_pair(chan: ipc.PushChannel, msg: object, n: int, tap: ipc.Tap) -> tuple[float, float]:
    """(without tap, with `tap`) us per send, runs interleaved so drift on a shared machine hits
    both alike; medians of 7."""
    without, with_ = [], []
    for _ in range(7):
        ipc._tap = None
        without.append(_once(chan, msg, n))
        ipc._tap = tap
        with_.append(_once(chan, msg, n))
    return statistics.median(without), statistics.median(with_)


def time_call(fn, n: int) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=50_000)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="vptap-")
    stop = threading.Event()
    sink = f"ipc://{d}/sink"
    threading.Thread(target=drain, args=(sink, zmq.PULL, stop), daemon=True).start()
    time.sleep(0.2)
    chan: ipc.PushChannel = ipc.PushChannel(sink)
    rows = []
    for i, (name, msg) in enumerate(messages().items()):
        tap = ipc.install_tap(f"ipc://{d}/tap{i}", "bench")  # fresh address: no earlier subscriber
        none, quiet = time_pair(chan, msg, args.n, tap)
        listener = threading.Event()
        threading.Thread(target=drain, args=(tap.addr, zmq.SUB, listener), daemon=True).start()
        time.sleep(0.3)
        _, listened = time_pair(chan, msg, args.n, tap)
        listener.set()
        rows.append((name, none, quiet, listened))
        tap.close()
        ipc._tap = None
        time.sleep(0.2)
    ipc._tap = None
    stage_none = time_call(lambda: ipc.publish_stage("rid", "first_byte_sent", bytes=4096), args.n)
    gate_none = time_call(ipc.tap_listening, args.n)
    ipc.install_tap(f"ipc://{d}/tap-stage", "bench")
    stage_quiet = time_call(lambda: ipc.publish_stage("rid", "first_byte_sent", bytes=4096), args.n)
    gate_quiet = time_call(ipc.tap_listening, args.n)
    print(f"{'message':<24} {'no tap':>9} {'tap, idle':>10} {'tap, 1 SUB':>11}   (us per send, median of 7)")
    for name, a, b, c in rows:
        print(f"{name:<24} {a:9.2f} {b:10.2f} {c:11.2f}   idle tap: {b - a:+.2f} us")
    print(f"{'publish_stage':<24} {stage_none:9.3f} {stage_quiet:10.3f}")
    print(f"{'tap_listening (the gate)':<24} {gate_none:9.3f} {gate_quiet:10.3f}")
    stop.set()


if __name__ == "__main__":
    main()
