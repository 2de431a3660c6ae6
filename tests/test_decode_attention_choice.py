"""`--decode-attention`: which kernel the decode steps get, by GPU, cache dtype and shape (the
kernels themselves run on the GPU: tests/gpu/test_gpu_xqa_parity.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_worker.attention import xqa as xqa_backend
from gpu_worker.attention.xqa import resolve_decode_attention


def cache(dtype=torch.float8_e4m3fn, page=16, head_dim=128, device="cuda"):
    """What the choice reads of a KV cache [L, P, 2, page, Hkv, D] (no GPU needed)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(28, 100, 2, page, 8, head_dim))


@pytest.fixture
def sm(monkeypatch):
    def on(major: int) -> None:
        monkeypatch.setattr(xqa_backend, "cuda_capability", lambda device: (major, 0))

    return on


def test_auto_takes_xqa_for_an_fp8_cache_on_hopper_only(sm):
    sm(9)
    assert resolve_decode_attention("auto", cache()) == "xqa"
    assert resolve_decode_attention("auto", cache(torch.bfloat16)) == "flashinfer"  # measured slower there
    assert (
        resolve_decode_attention("auto", cache(page=8)) == "flashinfer"
    )  # a page size XQA has no kernel for
    assert resolve_decode_attention("auto", cache(head_dim=320)) == "flashinfer"
    assert resolve_decode_attention("auto", cache(device="cpu")) == "flashinfer"
    assert resolve_decode_attention("flashinfer", cache()) == "flashinfer"
    sm(10)
    assert resolve_decode_attention("auto", cache()) == "flashinfer"  # not measured there
    assert resolve_decode_attention("xqa", cache(torch.bfloat16)) == "xqa"


def test_asking_for_xqa_where_it_cannot_run_says_why(sm):
    sm(8)
    with pytest.raises(ValueError, match="SM 9.x, 10.x or 12.x GPU, not SM 8.x"):
        resolve_decode_attention("xqa", cache())
    sm(9)
    with pytest.raises(ValueError, match="not 8 .--page-size."):
        resolve_decode_attention("xqa", cache(page=8))
    with pytest.raises(ValueError, match="must be one of auto, flashinfer, xqa"):
        resolve_decode_attention("fast", cache())
