"""The input arena every graph of a step reads, sent to the device with one copy.

The arena is one int64 device buffer holding every input a step's graphs read (token ids,
positions, KV write slots, meta, prefill page indices), laid out in named spans, with a host mirror
(pinned on GPU). Each step zeroes the host prefix it uses (zero is the padding value: token 0 at
position 0, written to page 0 offset 0), fills it and sends it with one host→device copy. Decode
spans come first, so a step without prompt rows copies only them (`decode_spans`, `fill_decode`;
the prefill lanes' in gpu_worker.runner.prefill_graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.runner.batch import StepBatch


class InputArena:
    """Named spans of one int64 device buffer and its host mirror (`sizes`: span name → entries,
    laid out in that order)."""

    def __init__(self, sizes: dict[str, int], device: torch.device | str) -> None:
        self.spans: dict[str, tuple[int, int]] = {}
        lo = 0
        for name, n in sizes.items():
            self.spans[name] = (lo, n)
            lo += n
        self.total = lo
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(lo, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(lo, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if cuda else None
        if self._copied is not None:
            self._copied.record()

    def end(self, name: str) -> int:
        lo, n = self.spans[name]
        return lo + n

    def host_view(self, name: str, n: int | None = None) -> torch.Tensor:
        lo, size = self.spans[name]
        return self.host[lo : lo + (size if n is None else n)]

    def dev_view(self, name: str, n: int | None = None) -> torch.Tensor:
        lo, size = self.spans[name]
        return self.dev[lo : lo + (size if n is None else n)]

    def begin(self, upto: int) -> None:
        """Wait until the last step's copies out of the host mirror are done, zero its first `upto`."""
        if self._copied is not None:
            self._copied.synchronize()
        self.host[:upto].zero_()

    def send(self, upto: int) -> None:
        self.dev[:upto].copy_(self.host[:upto], non_blocking=True)

    def seal(self) -> None:
        """Mark the end of this step's host→device copies (the arena's and the attention plans',
        which stage through pinned buffers of their own): the next `begin` waits for them."""
        if self._copied is not None:
            self._copied.record()


def decode_spans(bmax: int, n_codebooks: int, max_pages: int = 0, sequences: int = 1) -> dict[str, int]:
    """Arena spans of the decode graphs: a row per KV sequence (`sequences` per request); meta (slot,
    tokens sampled, prompt length) covers every request of the step, prefill ones included; d_kv
    holds the decode batch's KV page indices where the attention backend plans from them (last, so
    a decode-only step copies only the indices it uses; `max_pages` 0 where the backend keeps each
    slot's pages on the device)."""
    n = sequences * bmax
    spans = {"ids": n * n_codebooks, "pos": n, "where": 2 * n, "page": n, "off": n}
    spans["meta"] = 3 * bmax
    return {**spans, "d_kv": max_pages}


def fill_decode(arena: InputArena, dec: StepBatch, page_size: int) -> None:
    """Decode rows' positions and write slots into the (zeroed) host arena; their ids too when the
    batch carries them (with `last_rows` they are gathered on the device after the copy)."""
    n, c = dec.batch_size, dec.ids.shape[1]
    arena.host_view("ids", n * c).copy_(torch.from_numpy(np.ascontiguousarray(dec.ids).reshape(-1)))
    pos = np.asarray(dec.pos, dtype=np.int64)
    arena.host_view("pos", n).copy_(torch.from_numpy(pos))
    arena.host_view("where", 2 * n).copy_(torch.from_numpy(dec.row_where().reshape(-1)))
    page = np.fromiter((t[p // page_size] for t, p in zip(dec.page_tables, pos, strict=True)), np.int64, n)
    arena.host_view("page", n).copy_(torch.from_numpy(page))
    arena.host_view("off", n).copy_(torch.from_numpy(pos % page_size))
