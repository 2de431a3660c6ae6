"""FlashInfer attention over the paged KV cache: eager (`FlashInferAttention`, the GPU twin of
`TorchPagedAttention`) and in captured graphs (`FlashInferGraphs`).

`plan` turns a step's layout into FlashInfer's page-table arrays (indptr, indices, last page
length) and plans the decode kernel (every request has one row) or the prefill kernel (ragged rows,
causal). `forward` writes the step's keys/values into their pages and runs the planned kernel on
that layer's cache. flashinfer is imported here (and by gpu_worker.attention.xqa) only, so CPU
installs never need it.

In graphs, every wrapper's page-table buffers are fixed at capture (`use_cuda_graph=True`); each
step plans them again before its replay, with page indices read from the device arena: FlashInfer
copies host indices with a blocking copy, which would wait for the whole stream.
"""

from __future__ import annotations

import builtins
import logging
from types import ModuleType

import numpy as np
import torch

from common.pinned import ring
from gpu_worker.attention.interface import StepLayout, page_arrays, write_kv

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 << 20


def _max(*args, **kw):
    """Python's max, except over one 1-D tensor: that is reduced in one call (same value)."""
    if len(args) == 1 and not kw and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
        return args[0].max()
    return builtins.max(*args, **kw)


def import_flashinfer() -> ModuleType:
    """flashinfer, with a faster `plan`. Its wrappers take `max(kv_lens)` with Python's max over a
    host tensor, one 0-d tensor comparison per request: ~2.5 ms of host time per step at batch 384
    (the unbind/select/gt/item rows of bench/profile_step.py's profile at batch 384). Its
    decode and prefill modules get a `max` that reduces such a tensor in one call."""
    import flashinfer

    for name in ("decode", "prefill"):  # submodules the package imports itself
        module = getattr(flashinfer, name, None)
        if isinstance(module, ModuleType):
            module.max = _max
    return flashinfer


def zero_tile_table(wrapper) -> None:
    """A graph wrapper's page-locked plan buffer set to zeros, before its first plan. In a graph,
    FlashInfer's prefill kernel (and the decode on tensor cores, which is that kernel) runs on a
    fixed grid, `padded_batch_size` CTAs: at least what a plan split over the KV could use (the SMs
    times the CTAs each holds, over the KV heads: tens), more than most plans have tiles (a prefill
    graph of one prompt of 32 rows has 2). A plan writes the tile table (each CTA's request, query tile
    and KV tile) for its tiles only, and copies the whole table to the device, so the CTAs past them
    read what the page-locked buffer held before: `torch.empty(pin_memory=True)`, a block torch's
    host allocator may hand out again with another wrapper's plan in it. An entry of a plan with
    more requests names a request this wrapper lacks, and its CTA reads past the wrapper's indptr
    buffers and writes where they point (a kernel that runs for ever, or an illegal address). From
    zeros, those CTAs take request 0's first tile, and later plans of the wrapper (each with as
    many requests: a graph's layouts are padded to its bucket) leave entries of its own requests: a
    CTA past the tiles computes one of them again, the same bits to the same rows. FlashInfer tracks
    this as flashinfer-ai/flashinfer#4002; its fix (PR #5176) masks those CTAs off. A FlashInfer
    without that buffer is logged and left as it is."""
    buf = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
    if isinstance(buf, torch.Tensor):
        buf.zero_()
    else:
        log.warning(
            "flashinfer's %s has no _pin_memory_int_workspace_buffer: its graph plans' unused tile-table "
            "entries are not zeroed", type(wrapper).__name__,
        )  # fmt: skip


def plan_arrays(indptr: np.ndarray, last: np.ndarray, page_size: int, device: torch.device) -> dict:
    """A graph plan's host arrays as `plan` takes them (kv indptr, last page length, and the
    sequence lengths, from which it would otherwise build a tensor of its own), on the GPU staged in
    the pinned ring (common/pinned.py: fence it once `plan` has queued its copies). `plan` copies
    them into the graph's buffers with non-blocking copies, and from pageable memory such a copy
    first waits for everything queued on the stream: the host would lose its lead."""
    seq_lens = np.maximum(np.diff(indptr) - 1, 0) * page_size + last
    out = {"indptr": indptr, "last": last, "seq_lens": seq_lens.astype(np.int32)}
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
    if torch.device(device).type == "cuda":
        out = {k: ring().stage(v) for k, v in out.items()}
    return out


def write_slots(layout: StepLayout, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) int64 [N] where each row's key/value goes."""
    pos = layout.pos.cpu().numpy()
    page = np.empty(len(pos), dtype=np.int64)
    for b, table in enumerate(layout.page_tables):
        lo, hi = layout.qo_indptr[b], layout.qo_indptr[b + 1]
        page[lo:hi] = np.asarray(table, dtype=np.int64)[pos[lo:hi] // page_size]
    return page, pos % page_size


class FlashInferAttention:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_qo_heads: int,
        q_dtype: torch.dtype,
        tensor_cores: bool = True,
        decode_attention: str = "flashinfer",
        no_split_kv: bool = True,
    ) -> None:
        flashinfer = import_flashinfer()
        # one KV chunk per request, as in the graphs: a row's attention reduces in the same order
        # whatever else the step holds (`GpuWorkerSettings.no_split_kv`)
        self.no_split_kv = no_split_kv
        self.kv_cache = kv_cache  # [L, P, 2, page, Hkv, D]
        self.q_dtype = q_dtype  # queries and outputs: the model's dtype, whatever the cache holds
        self.page_size, self.num_kv_heads, self.head_dim = (
            kv_cache.shape[3],
            kv_cache.shape[4],
            kv_cache.shape[5],
        )
        self.num_qo_heads = num_qo_heads
        dev = kv_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # Tensor cores pay off for grouped-query attention (Llama-3.2-3B: 3 q heads per kv head).
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._wrapper = self.decode
        self.xqa = None  # decode steps on XQA instead (`decode_attention="xqa"`, resolved)
        if decode_attention == "xqa":
            from gpu_worker.attention.xqa import XqaDecode

            self.xqa = XqaDecode(kv_cache, num_slots=1, max_pages=1, max_batch=1)
        self._xqa_rows = 0  # > 0: this step decodes on XQA, this many rows

    def plan(self, layout: StepLayout) -> None:
        dev = self.kv_cache.device
        indptr, indices, last = page_arrays(layout.kv_lens, layout.page_tables, self.page_size)
        page, off = write_slots(layout, self.page_size)
        self._write_page = torch.from_numpy(page).to(dev, non_blocking=True)
        self._write_off = torch.from_numpy(off).to(dev, non_blocking=True)
        dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        qt, kt = self.q_dtype, self.kv_cache.dtype
        self._xqa_rows = 0
        if len(layout.qo_indptr) - 1 == len(layout.pos) and self.xqa is not None:
            self.xqa.set_rows(layout.page_tables, layout.kv_lens)
            self._xqa_rows = len(layout.kv_lens)
        elif len(layout.qo_indptr) - 1 == len(layout.pos):  # one row per request: decode
            self.decode.plan(
                torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), *dims,
                q_data_type=qt, kv_data_type=kt, disable_split_kv=self.no_split_kv,
            )  # fmt: skip
            self._wrapper = self.decode
        else:
            qo = torch.from_numpy(np.asarray(layout.qo_indptr, dtype=np.int32))
            self.prefill.plan(
                qo, torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), *dims,
                causal=True, q_data_type=qt, kv_data_type=kt, disable_split_kv=self.no_split_kv,
            )  # fmt: skip
            self._wrapper = self.prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_cache[layer]  # [P, 2, page, Hkv, D]
        write_kv(cache, self._write_page, self._write_off, k, v)
        if self._xqa_rows:
            return self.xqa.run(q, cache, self._xqa_rows)
        return self._wrapper.run(q, cache)


class FlashInferGraphs:
    """Prefill and decode attention of captured graphs on FlashInfer (gpu_worker.attention.interface.
    GraphAttentionBackend): one workspace for every graph's wrappers; each prefill graph's wrapper
    has buffers of its own, and the decode graphs' wrappers share slices of one set."""

    name = "flashinfer"

    def __init__(
        self, program, kv_cache: torch.Tensor, max_batch: int, max_pages: int, tensor_cores: bool,
        no_split_kv: bool,
    ) -> None:  # fmt: skip
        self.flashinfer = import_flashinfer()
        self.program, self.kv_cache = program, kv_cache
        self.page_size = kv_cache.shape[3]
        self.tensor_cores, self.no_split_kv = tensor_cores, no_split_kv
        self.max_batch, self.max_pages = max_batch, max_pages
        self.workspace: torch.Tensor | None = None  # with the decode buffers, at the first capture

    def _allocate(self) -> None:
        """The decode wrappers' page-table buffers and the workspace, allocated at the first capture
        (after the runner's input arena) as normal tensors, even under inference mode: the decode
        wrappers are planned outside it."""
        if self.workspace is not None:
            return
        dev = self.program.device
        with torch.inference_mode(False):
            self.kv_indptr = torch.zeros(self.max_batch + 1, dtype=torch.int32, device=dev)
            self.kv_indices = torch.zeros(self.max_pages, dtype=torch.int32, device=dev)
            self.kv_last = torch.zeros(self.max_batch, dtype=torch.int32, device=dev)
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)

    def decode_index_span(self, max_pages: int) -> int:
        return max_pages

    def admit(self, slots: np.ndarray, page_tables: list[list[int]]) -> None:
        pass  # a step's decode page tables come with its layout

    # --- prefill graphs ------------------------------------------------------------------------
    def prepare_capture_prefill(self, rows: int, reqs: int, max_pages: int, layout):
        self._allocate()
        dev = self.kv_cache.device
        # Buffers of its own per wrapper: a step plans prefill and decode before replaying either.
        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(reqs + 2, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(reqs + 2, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.zeros(reqs + 1, dtype=torch.int32, device=dev),
        )
        zero_tile_table(wrapper)
        # The first plan fixes the wrapper's row total: every later plan has exactly `rows`.
        self.prepare_replay_prefill(wrapper, layout, torch.from_numpy(layout.kv_indices))
        return wrapper

    def segments_plan_as_one(self, rows: int) -> bool:
        """FlashInfer's FA2 prefill kernel (the one it takes over a float8 cache) works in tiles of
        one request's query rows (packed with their query heads), each over the request's whole KV
        in one chunk with split-KV off, so a row's bits depend on the tile size alone. In a graph
        plan that size (CTA_TILE_Q, `FA2DetermineCtaTileQ`) follows the longest request the row
        total allows, (rows - entries + 1) x the query heads per KV head, and is 128 past 64 such
        rows (head dims under 256). A segment alone allows rows - 1; k segments in one plan allow
        more: where rows - 1 already passes 64, both take 128. Over a 16-bit cache FlashInfer
        takes its FA3 kernel on Hopper, not checked here: a wrapper a segment."""
        p = self.program
        packed = (rows - 1) * (p.num_qo_heads // p.num_kv_heads)
        fa2 = self.kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        return fa2 and self.no_split_kv and p.head_dim < 256 and packed > 64

    def prepare_replay_prefill(self, wrapper, layout, kv_indices: torch.Tensor) -> None:
        p, dt = self.program, self.kv_cache.dtype
        host = plan_arrays(layout.kv_indptr, layout.kv_last, self.page_size, p.device)
        qo_indptr = torch.from_numpy(layout.qo_indptr)
        if p.device.type == "cuda":
            qo_indptr = ring().stage(qo_indptr)  # see plan_arrays
        wrapper.plan(
            qo_indptr, host["indptr"], kv_indices, host["last"], p.num_qo_heads, p.num_kv_heads, p.head_dim,
            self.page_size, causal=True, q_data_type=p.dtype, kv_data_type=dt, disable_split_kv=self.no_split_kv,
            seq_lens=host["seq_lens"],
        )  # fmt: skip
        if p.device.type == "cuda":
            ring().fence()

    # --- decode graphs -------------------------------------------------------------------------
    def prepare_capture_decode(self, batch: int, pos: torch.Tensor):
        self._allocate()
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=self.kv_indptr[: batch + 1],
            paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last[:batch],
        )
        zero_tile_table(wrapper)
        indptr, indices, last = page_arrays([1] * batch, [[0]] * batch, self.page_size)
        self._plan_decode(wrapper, indptr, torch.from_numpy(indices), last)
        return wrapper

    def in_graph(self, wrapper) -> None:
        pass  # planned on the host before the replay

    def decode_layout(self, kv_lens: list[int], page_tables: list[list[int]]) -> tuple[np.ndarray, ...]:
        return page_arrays(kv_lens, page_tables, self.page_size)

    def decode_indices(self, kv: tuple[np.ndarray, ...]) -> np.ndarray:
        return kv[1]

    def prepare_replay_decode(self, wrapper, kv, kv_indices: torch.Tensor, rows) -> None:
        self._plan_decode(wrapper, kv[0], kv_indices, kv[2])

    def select_rows(self, slots: torch.Tensor) -> None:
        pass  # the decode rows' pages came with the plan

    def _plan_decode(self, wrapper, indptr: np.ndarray, indices: torch.Tensor, last: np.ndarray) -> None:
        """`indices` on the device when planning a step: FlashInfer copies host indices with a
        blocking copy, which would wait for the whole stream (all work queued before this step)."""
        p = self.program
        host = plan_arrays(indptr, last, self.page_size, p.device)
        wrapper.plan(
            host["indptr"], indices, host["last"], p.num_qo_heads, p.num_kv_heads, p.head_dim, self.page_size,
            q_data_type=p.dtype, kv_data_type=self.kv_cache.dtype, disable_split_kv=self.no_split_kv,
            seq_lens=host["seq_lens"],
        )  # fmt: skip
        if p.device.type == "cuda":
            ring().fence()
