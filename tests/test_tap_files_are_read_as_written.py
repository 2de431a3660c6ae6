"""A tap's recording (`bench ttfa --tap-out`) is written and read by one rule: gzipped where its
name ends in .gz, plain JSON lines otherwise, so a level's tap statistics read back what the bench
wrote whatever the name."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.tap_stats import read, write

EVENTS = [
    {"time": 1.5, "rid": "a", "stage": "received", "proc": "gateway"},
    {"time": 1.6, "rid": "a", "stage": "first_token", "proc": "gpu_worker", "text": "é ✓"},
]


@pytest.mark.parametrize("name", ["tap.jsonl", "tap.jsonl.gz", "tap"])
def test_a_tap_reads_back_as_written(tmp_path, name):
    path = str(tmp_path / name)
    data = "".join(json.dumps(e) + "\n" for e in EVENTS).encode() + b"\n"  # a blank line at the end
    write(path, data)
    raw = (tmp_path / name).read_bytes()
    if name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b" and gzip.decompress(raw) == data
    else:
        assert raw == data  # what `voxpipe tap` printed, as it printed it
    assert read(path) == EVENTS
