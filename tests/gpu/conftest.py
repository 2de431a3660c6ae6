"""The GPU test suite: fidelity and batch invariance of the serving path on a CUDA GPU, with dummy
weights (no checkpoint download). One command on a GPU machine:

    python -m pytest tests/gpu                         # add -s to see progress
    VOXPIPE_GPU_REPORT_DIR=out python -m pytest tests/gpu   # also writes out/<check>.json

Every test is skipped where `torch.cuda.is_available()` is false (the CPU suite collects them too).
The reports hold each check's numbers with the device and date: results of record come from them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from bench.provenance import commit


def pytest_collection_modifyitems(config, items) -> None:
    """A GPU test stuck in a kernel (a CUDA call that never returns) is past a signal's reach: its
    timeout (pytest-timeout's, 300 s) takes the thread method, which prints every thread's stack and
    ends the run instead of hanging it."""
    for item in items:
        if "gpu" in item.path.parts and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(method="thread"))


@pytest.fixture(scope="session", autouse=True)
def cuda_gpu() -> None:
    """Session-scoped, so that it skips before any module fixture loads a model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # bf16 GEMMs are compared as such
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def gpu_report() -> Iterator[Callable[[str], dict]]:
    """`gpu_report(name)` → the dict of report `name` (device, date and commit filled in); tests
    record their numbers in it before they assert. Written as VOXPIPE_GPU_REPORT_DIR/<name>.json at
    the end of the session when that variable is set."""
    reports: dict[str, dict] = {}

    def report(name: str) -> dict:
        if name not in reports:
            reports[name] = {
                "device": torch.cuda.get_device_name(),
                "date": time.strftime("%F"),
                "commit": commit(),
                "command": f"VOXPIPE_GPU_REPORT_DIR=DIR python -m pytest tests/gpu  ({name})",
            }
        return reports[name]

    yield report
    out = os.environ.get("VOXPIPE_GPU_REPORT_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        for name, res in reports.items():
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
