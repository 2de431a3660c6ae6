"""The cloning benchmarks against a served qwen3-tts-base-tiny (a Base model: no preset voice):
`bench ttfa --clone-reps` times requests with a new clip each and by a saved voice, and a load level
with a clone share reports its cloned and plain requests apart (`bench ttfa --clone-share` and
`bench load --clone-share`). Every clip the bench makes is a different sound (the server's clip
cache, keyed by the decoded samples, misses each time) that the gateway accepts."""

from __future__ import annotations

import json
import os

import pytest

from bench.clips import Cloning, clip_wav, split
from bench.load import Result
from bench.ttfa_http import main as ttfa_main
from gateway.clips import ClipLimits, decode_clip
from tests.conftest import Server, free_port

MODEL = "qwen3-tts-base-tiny"


def test_each_cloned_request_carries_a_clip_no_other_request_had():
    cloning = Cloning(share=0.5, seconds=1.0)
    forms = [cloning.request({"text": "Hi.", "min_tokens": 5, "stream": True}, True) for _ in range(4)]
    clips = [next(p for p in f._fields if p[0]["name"] == "audio")[2] for f in forms]
    limits = ClipLimits(10 << 20, 30.0)
    keys = {decode_clip(c, 24000, limits).key for c in clips}
    assert len(keys) == 4, "every cloned request sends a new sound"
    assert decode_clip(clip_wav(7, 2.0), 24000, limits).audio.shape == (48000,)
    fields = {p[0]["name"]: p[2] for p in forms[0]._fields}
    assert fields["min_tokens"] == "5" and fields["stream"] == "true" and fields["ref_text"]
    assert [cloning.client_clones(i, 4) for i in range(4)] == [True, True, False, False]
    assert [Cloning(share=0.25).client_clones(i, 2) for i in range(2)] == [True, False]  # half up
    assert Cloning(voice="v").request({"text": "Hi."}, False) == {"text": "Hi.", "voice": "v"}


def test_a_levels_cloned_and_plain_requests_are_summarized_apart():
    sr = 24000
    chunk = 2 * 2400  # 0.1 s of PCM16
    fast = [
        Result(ok=True, ttfa=0.05, sent_at=0.0, chunks=[(0.05, chunk), (0.1, 2 * chunk)]) for _ in range(3)
    ]
    slow = [
        Result(ok=True, ttfa=0.4, sent_at=0.0, cloned=True, chunks=[(0.4, chunk), (0.9, 2 * chunk)])
        for _ in range(2)
    ]
    from bench.load import summarize

    out = split(Cloning(share=0.4), [*fast, *slow], lambda part: summarize(part, 1.0, sr))
    assert out["clone_share"] == 0.4
    assert out["cloned"]["requests"] == 2 and out["cloned"]["ttfa_p50_ms"] == 400.0
    assert out["cloned"]["on_time_share"] == 0.0 and out["cloned"]["late_requests"] == 2
    assert out["plain"]["requests"] == 3 and out["plain"]["ttfa_p99_ms"] == 50.0
    assert out["plain"]["on_time_share"] == 1.0
    empty = split(Cloning(), fast, lambda part: summarize(part, 1.0, sr))["cloned"]
    assert empty["requests"] == 0 and empty["ttfa_p50_ms"] is None and empty["on_time_share"] is None


def check_levels(curve: list[dict], shares: list[float]) -> None:
    assert [p["clone_share"] for p in curve] == shares
    for point in curve:
        cloned, plain = point["cloned"], point["plain"]
        assert point["errors"] == 0 and cloned["errors"] == 0 and plain["errors"] == 0, point[
            "error_examples"
        ]
        assert cloned["requests"] + plain["requests"] == point["requests"]
        assert plain["requests"] >= 1 and plain["ttfa_p50_ms"] > 0
        if point["clone_share"] == 0:
            assert cloned["requests"] == 0 and cloned["on_time_share"] is None
        else:
            assert cloned["requests"] >= 1 and cloned["ttfa_p50_ms"] > 0 and 0 <= cloned["on_time_share"] <= 1


def test_bench_ttfa_times_clips_and_saved_voices_then_a_load_with_a_clone_share(tmp_path):
    out, load_out, voices = tmp_path / "clone.json", tmp_path / "clone-load.json", tmp_path / "voices"
    argv = ["--model", MODEL, "--port", str(free_port()), "--reps", "1", "--tokens", "10", "--clone-reps", "2",
            "--clip-seconds", "1", "--load", "2", "--clone-share", "0.5", "--load-duration", "2",
            "--load-tokens", "10", "--prompt-allowance", "60", "--out", str(out), "--load-out", str(load_out),
            "--client-procs", "2", "--", "--tokenizer-workers", "1", "--voices-dir", str(voices)]  # fmt: skip
    assert ttfa_main(argv) == 0
    res = json.loads(out.read_text())
    for key in ("clip_ttfa_ms", "voice_ttfa_ms"):
        q = res[key]
        assert len(q["samples"]) == 2 and all(t > 0 for t in q["samples"]), res
        assert 0 < q["p50"] <= q["p90"] <= q["p99"]
    assert len(res["ttfa_ms"]) == 1 and res["clip_seconds"] == 1.0
    # the plain requests spoke by a saved voice (a Base model has none of its own), the others by one
    assert {"bench-plain.json", "bench-saved.json"} <= set(os.listdir(voices))
    # the cloning client and the plain one each in a process of its own (client i in process i % 2)
    curve = json.loads(load_out.read_text())["curve"]
    check_levels(curve, [0.5])
    assert curve[0]["client_procs"] == 2


@pytest.fixture(scope="module")
def base_server():
    srv = Server("--model", MODEL, "--tokenizer-workers", "1")
    yield srv
    srv.stop()


def test_bench_load_splits_its_levels_by_clone_share(base_server, tmp_path):
    from bench.load_cli import main as load_main

    out = tmp_path / "load.json"
    argv = ["--url", base_server.base, "--concurrency", "2", "--duration", "2", "--tokens", "10",
            "--prompt-allowance", "60", "--clone-share", "0,0.5", "--clip-seconds", "1", "--progress", "0",
            "--out", str(out)]  # fmt: skip
    assert load_main(argv) == 0
    check_levels(json.loads(out.read_text())["curve"], [0.0, 0.5])
