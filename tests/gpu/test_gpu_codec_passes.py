"""A codec pass queues every window kind before it waits: the chained launches give exactly the
audio of the same graphs waited for one launch at a time (regular, lead and tail windows mixed, more
windows of one kind than a call holds), and so do two launches queued before either is read. The
distance to the eager codec (fp16: other batch sizes, other kernels) and the time of a mixed pass
chained against the same pass waited kind by kind go to the report.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from codec_worker.graphs import DetokGraphs, Pending
from codec_worker.worker import Codec
from common.messages import LEAD_NOISE_BASE, DetokChunk
from programs import get_spec, load_program_class


def chunks_of(gen: torch.Generator, plan: list[tuple[int, int]]) -> list[DetokChunk]:
    """(rows, tail rows) per chunk → Orpheus windows of random codes."""
    out = []
    for i, (rows, tail) in enumerate(plan):
        codes = torch.randint(0, 4096, (rows,), generator=gen)
        tokens = (128266 + 4096 * (torch.arange(rows) % 7) + codes).int().numpy().astype("<i4")
        noise = LEAD_NOISE_BASE + rows if rows < 28 or tail else i
        out.append(DetokChunk(f"r{i}", 0, 7 + i, tokens.tobytes(), noise, tail_rows=tail))
    return out


def diff(a: list[bytes], b: list[bytes]) -> int:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(
        int(np.abs(np.frombuffer(x, "<i2").astype(np.int32) - np.frombuffer(y, "<i2")).max(initial=0))
        for x, y in zip(a, b, strict=True)
    )


def test_chained_codec_launches_give_the_audio_of_launches_waited_one_by_one(gpu_report, monkeypatch):
    p = load_program_class("orpheus")(
        get_spec("orpheus"), load_format="dummy", device="cuda", codec_dtype="float16"
    )
    p.load_codec()
    graphs = Codec(p, max_batch=16, tails=True)
    eager = Codec(p, max_batch=16, graphs=False, tails=True)
    gen = torch.Generator().manual_seed(0)
    plan = [(28, 0)] * 40 + [(7, 0), (14, 7), (21, 7), (28, 7), (14, 0), (21, 0)] * 3
    order = torch.randperm(len(plan), generator=gen).tolist()
    chunks = chunks_of(gen, [plan[i] for i in order])
    want = [a.pcm for a in eager.decode(chunks)]
    got = [a.pcm for a in graphs.decode(chunks)]
    half = len(chunks) // 2
    # The same graphs, each launch waited for at once: the reference.
    launch = DetokGraphs.launch

    def synced_launch(self, t, k):
        out = launch(self, t, k).result()
        return Pending.later(lambda: out)

    with monkeypatch.context() as m:
        m.setattr(DetokGraphs, "launch", synced_launch)
        synced = [a.pcm for a in graphs.decode(chunks)]
        synced_halves = [a.pcm for a in graphs.decode(chunks[:half])] + [
            a.pcm for a in graphs.decode(chunks[half:])
        ]
    # Two launches queued before either is read (the urgent group and the rest), sharing kinds.
    first, second = graphs.launch(chunks[:half]), graphs.launch(chunks[half:])
    both = [a.pcm for a in graphs.collect(first)] + [a.pcm for a in graphs.collect(second)]

    res = gpu_report("codec-passes")
    res["windows"] = len(chunks)
    res["chained_vs_synced_max_pcm_diff"] = diff(got, synced)
    res["chained_vs_eager_max_pcm_diff"] = diff(got, want)
    res["two_queued_vs_synced_max_pcm_diff"] = diff(both, synced_halves)

    def waited_kind_by_kind() -> None:
        kinds: dict = {}
        for c in chunks:
            kinds.setdefault((len(c.tokens) // 4, c.tail_rows), []).append(c)
        for group in kinds.values():
            graphs.decode(group)

    for name, fn in (("chained_ms", lambda: graphs.decode(chunks)), ("kind_by_kind_ms", waited_kind_by_kind)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        res[name] = round((time.perf_counter() - t0) * 1000 / 20, 3)
    assert res["chained_vs_synced_max_pcm_diff"] == 0
    assert res["two_queued_vs_synced_max_pcm_diff"] == 0
