"""Decode attention on TensorRT-LLM's XQA kernels, as FlashInfer ships them (`flashinfer.xqa`).

Over an fp8 cache on Hopper, XQA's fp8 kernel (queries and probabilities in fp8 on the tensor
cores) reads half the bytes of a bf16 cache and keeps up with the memory: 28 layers at batch 384,
context 512, take 0.52x the time of FlashInfer's bf16 decode (FlashInfer's own fp8 paths are
slower than its bf16 one; bench/attention_kv.py, bench/xqa_parity.py). Its price is those
fp8 roundings: against FlashInfer over the same fp8 cache its outputs differ by up to ~0.3 on
values of a few units.

XQA reads a dense page table, [batch, pages per request], and the requests' lengths. The engine
reserves a request's pages for its whole budget at admission, so each sampling slot's row of the
table is written once, when its request brings its prompt (`admit`), and a step only gathers its
decode rows' slots (`gather`, a device op) and derives their lengths from their positions inside
the captured graph (`XqaWrapper.prepare`): no per-step page list leaves the host.

`XqaGraphs` is the graph backend: prefill graphs on FlashInfer, decode graphs on XQA.

A request is never split over several thread blocks (XQA is told it has one SM, which is what its
split rule reads): each request's attention reduces in the same order at any batch size.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.runner.slots import to_device

DECODE_ATTENTION = ("auto", "flashinfer", "xqa")
SCRATCH_BYTES = 16 << 20  # XQA's scratch for split requests (unused without splits)
SEMAPHORE_BYTES = 8 << 20  # zero at the start; XQA leaves them zero


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


XQA_PAGE_SIZES = (16, 32, 64, 128)


def resolve_decode_attention(choice: str, kv_cache: torch.Tensor) -> str:
    """flashinfer or xqa for a cache [L, P, 2, page, Hkv, D]. auto: XQA for an fp8 cache on Hopper
    (where it measures faster) when XQA takes its page size and head size, FlashInfer
    otherwise; xqa: wherever XQA runs (SM 9.x, 10.x, 12.x), or a clear error."""
    if choice not in DECODE_ATTENTION:
        raise ValueError(f"decode attention must be one of {', '.join(DECODE_ATTENTION)}, not {choice!r}")
    if kv_cache.device.type != "cuda" or choice == "flashinfer":
        return "flashinfer"
    major = cuda_capability(kv_cache.device)[0]
    page, head_dim = kv_cache.shape[3], kv_cache.shape[5]
    why_not = ""
    if major not in (9, 10, 12):
        why_not = f"needs an SM 9.x, 10.x or 12.x GPU, not SM {major}.x"
    elif page not in XQA_PAGE_SIZES:
        why_not = f"takes pages of {', '.join(map(str, XQA_PAGE_SIZES))} tokens, not {page} (--page-size)"
    elif head_dim % 16 or head_dim > 256:
        why_not = f"takes head sizes that are multiples of 16 up to 256, not {head_dim}"
    if choice == "auto":
        return "xqa" if not why_not and major == 9 and kv_cache.dtype == torch.float8_e4m3fn else "flashinfer"
    if why_not:
        raise ValueError(f"--decode-attention xqa {why_not}")
    return "xqa"


class XqaDecode:
    """The dense page tables XQA reads: one row per sampling slot, and the step's decode rows."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, max_pages: int, max_batch: int) -> None:
        from flashinfer.xqa import xqa

        dev = kv_cache.device
        self.kernel = xqa
        self.page_size, self.num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
        i32 = dict(dtype=torch.int32, device=dev)
        # Rows of never-used slots, and columns past a request's pages, hold page 0: a padding row
        # (length 1) reads one key from whatever row it gets, always a valid page.
        self.slot_pages = torch.zeros(num_slots, max_pages, **i32)  # [S, pages]
        self.table = torch.zeros(max_batch, max_pages, **i32)  # [B, pages]: this step's decode rows
        self.lens = torch.ones(max_batch, **i32)  # [B] keys each row attends to
        self.scratch = torch.zeros(SCRATCH_BYTES, dtype=torch.uint8, device=dev)
        self.semaphores = torch.zeros(SEMAPHORE_BYTES, dtype=torch.uint8, device=dev)

    def admit(self, slots: np.ndarray, page_tables: list[list[int]]) -> None:
        """New requests' page lists into their slots' rows (each request's pages never change), all
        in one copy: the rows side by side, page 0 past each request's pages."""
        if not page_tables:
            return
        rows = np.zeros((len(page_tables), max(map(len, page_tables))), dtype=np.int32)
        for i, pages in enumerate(page_tables):
            rows[i, : len(pages)] = pages
        dev = self.slot_pages.device
        index = to_device(torch.from_numpy(np.asarray(slots, dtype=np.int64)), dev)
        self.slot_pages[index, : rows.shape[1]] = to_device(torch.from_numpy(rows), dev)

    def gather(self, slots: torch.Tensor) -> None:
        """The step's decode rows' table from their slots [n] (on the device)."""
        torch.index_select(self.slot_pages, 0, slots, out=self.table[: slots.shape[0]])

    def set_rows(self, page_tables: list[list[int]], kv_lens: list[int], grow: bool = True) -> None:
        """Without slots (eager steps, offline use): the rows and lengths straight from the host,
        in tables grown to fit; `grow` False where captured graphs hold the tables."""
        n, width = len(page_tables), max(map(len, page_tables))
        if n > self.table.shape[0] or width > self.table.shape[1]:
            if not grow:
                raise ValueError(
                    f"{n} rows of {width} pages do not fit XQA's table {tuple(self.table.shape)}"
                )
            rows, cols = max(n, self.table.shape[0]), max(width, self.table.shape[1])
            self.table = torch.zeros(rows, cols, dtype=torch.int32, device=self.table.device)
            self.lens = torch.ones(rows, dtype=torch.int32, device=self.lens.device)
        host = np.zeros((n, self.table.shape[1]), dtype=np.int32)
        for i, pages in enumerate(page_tables):
            host[i, : len(pages)] = pages
        self.table[:n] = to_device(torch.from_numpy(host), self.table.device)
        self.lens[:n] = to_device(torch.tensor(kv_lens, dtype=torch.int32), self.lens.device)

    def wrapper(self, batch: int, pos: torch.Tensor) -> XqaWrapper:
        """What a decode graph of `batch` rows captures in place of a FlashInfer wrapper; `pos`:
        where it reads the rows' positions."""
        return XqaWrapper(self, batch, pos)

    def run(self, q: torch.Tensor, cache: torch.Tensor, batch: int) -> torch.Tensor:
        """q [B, Hq, D] over one layer's cache [P, 2, page, Hkv, D] → [B, Hq, D]."""
        k, v = cache.unbind(1)  # [P, page, Hkv, D] each: strided views of the interleaved pages
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel(
            q.unsqueeze(1), k, v, self.table[:batch], self.lens[:batch].view(torch.uint32).unsqueeze(1),
            out.unsqueeze(1), self.scratch, self.semaphores, self.num_kv_heads, self.page_size, sm_count=1,
        )  # fmt: skip
        return out


class XqaWrapper:
    """XQA in a decode graph, where `GraphAttention` takes a FlashInfer wrapper: it writes the rows'
    keys/values, then `run`s attention over the gathered table."""

    def __init__(self, xqa: XqaDecode, batch: int, pos: torch.Tensor) -> None:
        self.xqa, self.batch, self.pos = xqa, batch, pos

    def prepare(self) -> None:
        """Once per step, before the layers: each row attends to its position + 1 keys."""
        self.xqa.lens[: self.batch].copy_(self.pos + 1)

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return self.xqa.run(q, cache, self.batch)


class XqaGraphs:
    """Attention of captured graphs with decode on XQA and prefill on FlashInfer (`prefill`, a
    gpu_worker.attention.flashinfer.FlashInferGraphs): each slot's pages (a request's whole budget,
    reserved at admission) as a row of a device table, written when the request is admitted,
    gathered per step by the decode rows' slots."""

    name = "xqa"

    def __init__(self, xqa: XqaDecode, prefill) -> None:
        self.xqa, self.prefill = xqa, prefill

    def prepare_capture_prefill(self, rows: int, reqs: int, max_pages: int, layout):
        return self.prefill.prepare_capture_prefill(rows, reqs, max_pages, layout)

    def prepare_replay_prefill(self, wrapper, layout, kv_indices: torch.Tensor) -> None:
        self.prefill.prepare_replay_prefill(wrapper, layout, kv_indices)

    def segments_plan_as_one(self, rows: int) -> bool:
        return self.prefill.segments_plan_as_one(rows)

    def decode_index_span(self, max_pages: int) -> int:
        return 0  # each slot's pages live on the device

    def admit(self, slots: np.ndarray, page_tables: list[list[int]]) -> None:
        self.xqa.admit(slots, page_tables)

    def prepare_capture_decode(self, batch: int, pos: torch.Tensor) -> XqaWrapper:
        return self.xqa.wrapper(batch, pos)

    def in_graph(self, wrapper: XqaWrapper) -> None:
        wrapper.prepare()  # the rows' lengths from their positions

    def decode_layout(self, kv_lens: list[int], page_tables: list[list[int]]) -> None:
        return None

    def decode_indices(self, kv: None) -> None:
        return None

    def prepare_replay_decode(self, wrapper, kv, kv_indices: torch.Tensor, rows) -> None:
        if rows is not None:  # no slots (offline use): the decode rows' tables from the host
            self.xqa.set_rows(*rows, grow=False)

    def select_rows(self, slots: torch.Tensor) -> None:
        self.xqa.gather(slots)  # the decode rows' page tables, by slot
