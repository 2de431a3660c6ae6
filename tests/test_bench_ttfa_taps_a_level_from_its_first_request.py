"""`bench ttfa --tap-level L --tap-from-start`: the tap of a Poisson level connects before the
level's first request, so the recording holds the load's start (the requests that came to a
server idle after the single streams), which a tap from 2 s into the level misses. `--tap-out`
names a plain file here (JSON lines, as `voxpipe tap` prints them); one ending in .gz is gzipped
(tests/test_tap_files_are_read_as_written.py)."""

from __future__ import annotations

import json

from bench.ttfa_http import main as ttfa_main
from tests.conftest import free_port


def test_a_poisson_levels_tap_holds_its_first_request(tmp_path):
    out, load_out, tap = tmp_path / "ttfa.json", tmp_path / "load.json", tmp_path / "tap.jsonl"
    argv = ["--model", "orpheus-tiny", "--port", str(free_port()), "--reps", "1", "--tokens", "10",
            "--rate", "4", "--load-duration", "1.5", "--load-tokens", "20", "--prompt-allowance", "60",
            "--tap-level", "4", "--tap-from-start", "--tap-seconds", "3", "--tap-out", str(tap),
            "--out", str(out), "--load-out", str(load_out), "--", "--tokenizer-workers", "1"]  # fmt: skip
    assert ttfa_main(argv) == 0
    (point,) = json.loads(load_out.read_text())["curve"]
    received = {e["rid"] for e in map(json.loads, tap.read_text().splitlines()) if e["stage"] == "received"}
    first = next(r for r in received if r.startswith("load-") and r.endswith("-0"))  # the level's first
    assert first and point["tap"]["first_audio_complete"] == point["requests"], point["tap"]


def test_a_bursts_timeline_is_its_first_wave(tmp_path):
    """A burst level's tap follows the whole level, and its stage timeline the burst itself: the
    first requests of its three clients, not those each sends as its stream ends."""
    load_out, tap = tmp_path / "load.json", tmp_path / "tap.jsonl"
    argv = ["--model", "orpheus-tiny", "--port", str(free_port()), "--reps", "1", "--tokens", "10",
            "--load", "3", "--burst", "--load-duration", "2", "--load-tokens", "20",
            "--prompt-allowance", "60", "--tap-level", "3", "--tap-seconds", "4", "--tap-out", str(tap),
            "--out", str(tmp_path / "ttfa.json"), "--load-out", str(load_out), "--",
            "--tokenizer-workers", "1"]  # fmt: skip
    assert ttfa_main(argv) == 0
    (point,) = json.loads(load_out.read_text())["curve"]
    assert point["arrivals"] == "burst" and point["requests"] > 3  # the clients' next requests too
    assert point["tap"]["first_audio_complete"] > 3 and point["tap"]["timeline_requests"] == 3, point["tap"]
