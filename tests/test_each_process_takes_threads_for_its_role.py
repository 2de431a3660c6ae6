"""Each process computes with a thread count that fits its role and the host by default (so the
gpu_worker and codec_worker of a CPU deployment do not fight over the cores), and `--threads` /
`VOXPIPE_THREADS` overrides it for every process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import ServeConfig
from common.launcher import Supervisor
from common.options import parse_role
from common.threads import thread_count


@pytest.mark.parametrize(
    "cores, pairs, gpu, codec", [(1, 1, 1, 1), (2, 1, 1, 1), (16, 1, 8, 8), (16, 2, 4, 4), (3, 4, 1, 1)]
)
def test_compute_processes_split_the_cores_and_the_light_ones_take_one(
    cores: int, pairs: int, gpu: int, codec: int
) -> None:
    cfg = ServeConfig(gpu_workers=pairs)
    assert thread_count("gateway", cfg, cores) == thread_count("tokenizer_worker", cfg, cores) == 1
    assert (thread_count("gpu_worker", cfg, cores), thread_count("codec_worker", cfg, cores)) == (gpu, codec)


def test_the_setting_overrides_every_role_from_flag_or_environment() -> None:
    cfg = parse_role("gpu_worker", ["--threads", "3", "--gpu-in", "ipc:///tmp/x"]).cfg
    assert cfg.threads == 3 and thread_count("gpu_worker", cfg, 64) == thread_count("gateway", cfg, 64) == 3
    env = {"VOXPIPE_THREADS": "2"}
    assert parse_role("codec_worker", ["--codec-in", "ipc:///tmp/c"], env).cfg.threads == 2
    with pytest.raises(ValueError, match="--threads"):
        ServeConfig(threads=-1).check()


def test_serve_gives_each_child_its_count_in_the_environment(tmp_path) -> None:
    cfg = ServeConfig(run_dir=str(tmp_path), threads=0)
    sup = Supervisor(cfg)
    cores = len(os.sched_getaffinity(0))
    for child in sup.children:
        env = sup.child_env(child)
        want = 1 if child.role in ("gateway", "tokenizer_worker") else max(1, cores // 2)
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(want), child.name


def test_a_worker_process_sets_torchs_pool_to_its_count() -> None:
    code = (
        "import torch, sys; from common.config import ServeConfig; from common.threads import apply_threads;"
        "n = apply_threads('gpu_worker', ServeConfig(threads=3)); print(n, torch.get_num_threads())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "3"]
