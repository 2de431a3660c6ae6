"""Several gpu_workers (each with its codec_worker) behind one gateway and tokenizer pool: prompts go
to the worker with free capacity (the pool protocol with credits), aborts reach the worker holding
the request. The dispatcher's rules in-process first, then a real `voxpipe serve --gpu-workers 2`
on orpheus-tiny (CPU), observed through /ready and the per-process series of /metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import pair_devices
from common.ipc import numbered
from common.messages import Abort, Prompt, SamplingParams
from tests.conftest import Server, gpu_dispatch

# --- the dispatcher with credits, in one process ------------------------------------------------------


def _prompt(rid: str) -> Prompt:
    return Prompt(rid, b"\x00\x00\x00\x00", 1, SamplingParams())


def test_prompts_go_to_the_worker_with_credit_and_wait_when_all_are_full():
    with gpu_dispatch("a", "b") as (loop, pool, workers):
        a, b = workers["a"], workers["b"]
        got: dict[str, list] = {"a": [], "b": []}

        def spin(seconds: float, offers: dict[str, int] | None = None) -> None:
            """Run the dispatcher while the workers announce `offers` and collect what they get."""

            async def go() -> None:
                pool.start()
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for name, chan in (("a", a), ("b", b)):
                        if offers and name in offers:
                            chan.offer(offers[name])
                        got[name] += chan.drain()
                    await asyncio.sleep(0.01)

            loop.run_until_complete(go())

        spin(0.3, {"a": 2, "b": 1})
        sends = [loop.create_task(pool.send(_prompt(f"p{i}"))) for i in range(4)]
        spin(0.3)  # nobody announces anew: the credit already given is all they get
        assert [len(got["a"]), len(got["b"])] == [2, 1]
        assert [t.done() for t in sends] == [True, True, True, False], "a full worker was sent a prompt"
        assert pool.dispatched == {"a": 2, "b": 1}
        # The broadcast Abort reaches both, outside the credit count (the fourth prompt still waits).

        async def abort() -> int:
            return pool.broadcast(Abort(["p0"]))

        assert loop.run_until_complete(abort()) == 2
        spin(0.2)
        assert isinstance(got["a"][-1], Abort) and isinstance(got["b"][-1], Abort)
        assert not sends[3].done()
        # b finishes its prompt: it announces one free slot (seq 1, credit 1) and takes the fourth.
        spin(0.3, {"b": 1})
        assert sends[3].done() and [m.rid for m in got["b"] if isinstance(m, Prompt)][-1] == "p3"
        assert pool.dispatched == {"a": 2, "b": 2}


def test_each_pair_gets_a_device_and_a_codec_inbox():
    assert pair_devices("cpu", 2) == ["cpu", "cpu"]
    assert pair_devices("auto", 2, cuda_available=lambda: False) == ["cpu", "cpu"]
    assert pair_devices("auto", 2, cuda_available=lambda: True) == ["cuda:0", "cuda:1"]
    assert pair_devices("cuda", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert pair_devices("cuda:1,cuda:0", 2) == ["cuda:1", "cuda:0"]
    assert pair_devices("auto", 1) == ["auto"]
    with pytest.raises(ValueError, match="lists 3 devices for 2"):
        pair_devices("cuda:0,cuda:1,cuda:2", 2)
    assert numbered("ipc:///run/vp/codec_in", 1) == "ipc:///run/vp/codec_in.1"
    assert numbered("tcp://codec:5560", 2) == "tcp://codec:5562"


# --- a real server with two gpu_workers ---------------------------------------------------------------

MAX_BATCH = 2


@pytest.fixture(scope="module")
def two() -> Iterator[Server]:
    srv = Server("--gpu-workers", "2", "--device", "cpu", "--max-batch-size", str(MAX_BATCH))
    yield srv
    srv.stop()


def gpu_series(srv: Server) -> dict[str, dict[str, float]]:
    """metric → {gpu_worker process name: value} from /metrics."""
    with urllib.request.urlopen(srv.base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("role") == "gpu_worker":
                out.setdefault(s.name, {})[s.labels["process"]] = s.value
    return out


def generate(srv: Server, text: str, max_tokens: int, seed: int = 0) -> int:
    body = json.dumps({"text": text, "max_tokens": max_tokens, "seed": seed, "streaming": False}).encode()
    req = urllib.request.Request(
        srv.base + "/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.read(4) == b"RIFF"
        return r.status


def test_ready_expects_every_pair_by_name(two):
    names = {p["name"] for p in two.ready["processes"]}
    assert {"gpu_worker.0", "gpu_worker.1", "codec_worker.0", "codec_worker.1"} <= names
    assert "gpu_worker" not in names


def test_concurrent_requests_all_complete_on_both_workers_and_none_queues_in_a_full_one(two):
    before = gpu_series(two).get("voxpipe_generated_tokens_total", {})
    n = 3 * MAX_BATCH  # more than both workers hold at once: the rest wait at the gateway
    statuses: list[int] = []
    peak: dict[str, float] = {"queue": 0.0, "active": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = gpu_series(two)
            peak["queue"] = max([peak["queue"], *m.get("voxpipe_queue_depth", {}).values()])
            peak["active"] = max([peak["active"], *m.get("voxpipe_active_streams", {}).values()])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [
        threading.Thread(target=lambda i=i: statuses.append(generate(two, f"Request {i}.", 160, seed=i)))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    done.set()
    watcher.join()
    assert statuses == [200] * n
    after = gpu_series(two)["voxpipe_generated_tokens_total"]
    served = {name: after[name] - before.get(name, 0.0) for name in after}
    assert set(served) == {"gpu_worker.0", "gpu_worker.1"}
    assert all(v > 0 for v in served.values()), f"a worker served nothing: {served}"
    assert peak["queue"] == 0, "a full gpu_worker was sent a prompt to queue"
    assert 0 < peak["active"] <= MAX_BATCH


def test_an_abort_reaches_the_worker_holding_the_request(two):
    def pages() -> dict[str, float]:
        return gpu_series(two).get("voxpipe_kv_pages_used", {})

    tokens_before = gpu_series(two).get("voxpipe_generated_tokens_total", {})  # none yet on a fresh server
    conn = http.client.HTTPConnection("127.0.0.1", two.port, timeout=60)
    body = json.dumps({"text": "A long one, cut short.", "max_tokens": 400, "streaming": True})
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read(44 + 4096)  # header and the first audio: the request runs on one worker
    deadline = time.monotonic() + 10
    while not any(v > 0 for v in pages().values()):
        assert time.monotonic() < deadline, "no worker reports the request's KV pages"
        time.sleep(0.05)
    holder = max(pages().items(), key=lambda kv: kv[1])[0]
    conn.close()  # the client goes away: the gateway aborts the request
    deadline = time.monotonic() + 10
    while any(v > 0 for v in pages().values()):
        assert time.monotonic() < deadline, f"KV pages still held after the abort: {pages()}"
        time.sleep(0.05)
    generated = gpu_series(two)["voxpipe_generated_tokens_total"][holder] - tokens_before.get(holder, 0.0)
    assert generated < 300, "the request ran to its budget (400, prompt included) instead of being aborted"


def test_serve_refuses_a_device_list_that_does_not_match_the_gpu_workers(capsys):
    from common.cli import main

    for argv, message in (
        (["--gpu-workers", "0"], "--gpu-workers must be at least 1"),
        (["--gpu-workers", "2", "--device", "cuda:0,cuda:1,cuda:2"], "list 3 devices but --gpu-workers is 2"),
    ):
        with pytest.raises(SystemExit):
            main(["serve", "--model", "orpheus-tiny", *argv])
        assert message in capsys.readouterr().err
