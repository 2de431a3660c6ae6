"""`voxpipe tap --rid X`, attached to a local `voxpipe serve` through its state file, prints the
stages of request X across every hop, in order, as JSON lines."""

from __future__ import annotations

import io
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import IO

import msgspec
import pytest
import zmq

from bench.tap_stats import stats as tap_stats
from common import ipc
from common.messages import Prompt, SamplingParams, StageEvent, TapHeader, TapMsg
from common.tap import Timeline, events_of, find_taps
from tests.conftest import ROOT, free_port, wait_ready, worker_env

CAUSAL = [  # each stage causes the next: their times must increase in this order
    "http_received",
    "received",
    "dispatched",
    "prompt_built",
    "routed",
    "admitted",
    "first_token",
    "first_chunk_ready",
    "first_chunk_decoded",
    "first_byte_sent",
]
ENDING = ["finished", "codec_finished", "response_done"]


def _lines(stream: IO[str], out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


class Proc:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        for stream, q in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=_lines, args=(stream, q), daemon=True).start()

    def wait_line(self, q: queue.Queue, pred, timeout: float) -> list[str]:
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = q.get(timeout=0.1)
            except queue.Empty:
                continue
            got.append(line)
            if pred(line):
                return got
        raise TimeoutError(f"no matching line in {timeout} s; got {got}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()


@pytest.fixture
def served(tmp_path, monkeypatch) -> Iterator[tuple[str, dict[str, str]]]:
    # Its own runtime dir: `voxpipe tap` must find this server, not another test's.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    env = {**worker_env(), "XDG_RUNTIME_DIR": str(tmp_path)}
    port = free_port()
    argv = [sys.executable, "-m", "common.cli", "serve", "--model", "orpheus-tiny", "--port", str(port)]
    serve = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", serve)
        yield f"http://127.0.0.1:{port}", env
    finally:
        serve.terminate()
        serve.wait(20)


def test_tap_with_a_rid_prints_that_requests_stages_in_order(served):
    base, env = served
    assert len(find_taps()) == 4, "the state file lists every process's tap"
    rid = f"taptest-{uuid.uuid4().hex[:12]}"
    tap = Proc([sys.executable, "-m", "common.cli", "tap", "--rid", rid], env)
    try:
        tap.wait_line(tap.err, lambda line: line.startswith("tap: connected 4/4"), timeout=20)
        time.sleep(0.2)  # publishers read new subscriptions every 50 ms
        req = urllib.request.Request(
            base + "/generate",
            data=json.dumps({"text": "Traced.", "seed": 1, "max_tokens": 100}).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": rid},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and len(r.read()) > 44
            assert r.headers["X-Request-Id"] == rid
        lines = tap.wait_line(tap.out, lambda line: '"response_done"' in line, timeout=20)
    finally:
        tap.stop()
    events = [json.loads(line) for line in lines]
    assert {e["rid"] for e in events} == {rid}
    stages = [e["stage"] for e in events]
    assert sorted(stages) == sorted(CAUSAL + ENDING), stages
    times = [e["time"] for e in events]
    assert times == sorted(times), "printed in time order"
    at = {e["stage"]: e["time"] for e in events}
    assert [at[s] for s in CAUSAL] == sorted(at[s] for s in CAUSAL), stages
    assert at["finished"] <= at["codec_finished"] <= at["response_done"] == max(times)
    assert all(e["ms"] >= 0 for e in events) and {e["proc"] for e in events} >= {"gateway", "gpu_worker"}
    # bench/tap_stats.py splits the first audio into its stages: they add up to the whole.
    split = tap_stats(events)
    assert split["requests_seen"] == split["first_audio_complete"] == 1
    parts = {k: v["p50"] for k, v in split["first_audio_ms"].items()}
    whole, from_http = parts.pop("total"), parts.pop("total_from_http")
    before = parts.pop("http_received->received")  # reading the body, the admission wait
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) == pytest.approx(whole, abs=0.05)
    assert whole == pytest.approx(1000 * (at["first_byte_sent"] - at["received"]), abs=0.01)
    assert from_http == pytest.approx(whole + before, abs=0.05)
    assert split["codec_ms_per_chunk"]["n"] == 1  # the first chunk (no --all-chunks)
    # Joined to the client's own timing of the same request id: what the client saw beyond it.
    joined = tap_stats(events, {rid: from_http + 7.5, "another": 1.0})["client_minus_server_ms"]
    assert joined["n"] == 1 and joined["p50"] == pytest.approx(7.5, abs=0.01)
    # ... split at the gateway's handler, given when the client began (its wall clock, this host's)
    began = {rid: at["http_received"] - 0.003}
    split = tap_stats(events, {rid: from_http + 7.5}, began)
    assert split["client_to_handler_ms"]["p50"] == pytest.approx(3.0, abs=0.01)
    assert split["first_byte_to_client_ms"]["p50"] == pytest.approx(4.5, abs=0.01)


def test_a_tap_mirrors_nothing_until_someone_subscribes_then_every_send(tmp_path):
    addr = f"ipc://{tmp_path}/tap"
    sink = f"ipc://{tmp_path}/sink"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(sink)
    chan: ipc.PushChannel = ipc.PushChannel(sink)
    tap = ipc.install_tap(addr, "proc-x")
    try:
        msg = Prompt("r1", b"\0\0\0\0", 1, SamplingParams())
        chan.send(msg)
        assert not tap.listening
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(addr)
        deadline = time.monotonic() + 5
        while not ipc.tap_listening():
            assert time.monotonic() < deadline, "the subscription never reached the tap"
            time.sleep(0.01)
        chan.send(msg)
        ipc.publish_stage("r1", "admitted", 12.5, slot=3)
        assert sub.poll(2000)
        header, payload = sub.recv_multipart()
        h = msgspec.msgpack.decode(header, type=TapHeader)
        assert h.proc == "proc-x" and h.addr == sink
        assert msgspec.msgpack.decode(payload, type=TapMsg) == msg
        assert sub.poll(2000)
        stage = msgspec.msgpack.decode(sub.recv_multipart()[1], type=TapMsg)
        assert stage == StageEvent("r1", "admitted", 12.5, {"slot": 3})
        assert not sub.poll(100), "the send before anyone listened was not mirrored"
        sub.close(linger=0)
    finally:
        tap.close()
        ipc._tap = None
        chan.close()
        pull.close(linger=0)


def test_timeline_lines_keep_their_own_fields_and_come_out_in_time_order():
    out = io.StringIO()
    timeline = Timeline(rids={"a"}, stages=set(), all_chunks=False, reorder_s=0.0, out=out)
    h = TapHeader(proc="gpu_worker", time=5.0)
    late = StageEvent("a", "first_token", 3.0, {"rid": "forged", "step": 1})
    early = Prompt("a", b"", 0, SamplingParams(), arrival=1.0)
    timeline.add(
        events_of(h, late) + events_of(TapHeader("tok", 2.0), early) + events_of(h, StageEvent("b", "x"))
    )
    timeline.flush(force=True)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["stage"] for e in lines] == ["prompt_built", "first_token"]
    assert lines[1] == {
        "time": 3.0,
        "ms": 2000.0,
        "rid": "a",
        "stage": "first_token",
        "proc": "gpu_worker",
        "step": 1,
    }


def test_a_text_in_segments_joins_the_client_by_its_request_id():
    # A long text's first segment carries the first audio's stages as "<request id>/0".
    t = {"http_received": 0.0, "received": 0.002, "prompt_built": 0.003, "admitted": 0.004,
         "first_token": 0.03, "first_chunk_ready": 0.1, "first_chunk_decoded": 0.11, "first_byte_sent": 0.112}  # fmt: skip
    events = [{"time": 100 + v, "rid": "x/0", "stage": k, "proc": "gateway"} for k, v in t.items()]
    split = tap_stats(events, {"x": 120.0})
    assert split["first_audio_complete"] == 1
    assert split["first_audio_ms"]["total_from_http"]["p50"] == pytest.approx(112.0, abs=0.01)
    assert split["client_minus_server_ms"]["p50"] == pytest.approx(8.0, abs=0.01)
