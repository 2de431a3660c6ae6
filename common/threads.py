"""How many CPU threads each process computes with: one count per role that fits the machine.

Every process of a deployment shares the host's cores. Left to themselves, torch and its OpenMP /
MKL runtimes give *each* process one thread per core, so on a small CPU host the gpu_worker's and
the codec_worker's thread pools fight over the same cores, and a spinning OpenMP pool in one
process stalls the other: the embedded default model then runs slower than real time. So by
default (`--threads 0`, auto):

- the gateway and the tokenizer workers take 1 thread (an event loop; short prompt builds);
- the gpu_worker and codec_worker processes split the cores between them: each takes
  max(1, cores // (2 × gpu_workers)) (they run side by side, one pair per `--gpu-workers`).

`--threads N` / `VOXPIPE_THREADS` gives every process N instead. The count goes to
`OMP_NUM_THREADS` and `MKL_NUM_THREADS` (read when the runtimes start: the launcher sets them in each
child's environment) and to `torch.set_num_threads` where torch is loaded. `common` never imports
torch itself: `apply_threads` only calls into a torch the process already imported.
"""

from __future__ import annotations

import os
import sys

from common.config import ServeConfig

LIGHT_ROLES = ("gateway", "tokenizer_worker")  # event loops and prompt builds: one thread each
_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, which container limits set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_count(role: str, cfg: ServeConfig, cores: int | None = None) -> int:
    """The threads `role` computes with under `cfg` on a host of `cores` cores."""
    if cfg.threads > 0:
        return cfg.threads
    if role in LIGHT_ROLES:
        return 1
    cores = host_cores() if cores is None else cores
    return max(1, cores // (2 * max(1, cfg.gpu_workers)))


def thread_env(role: str, cfg: ServeConfig, cores: int | None = None) -> dict[str, str]:
    """The environment variables that give a child process of `role` its thread count."""
    n = str(thread_count(role, cfg, cores))
    return {name: n for name in _ENV}


def apply_threads(role: str, cfg: ServeConfig) -> int:
    """Give this process its thread count: the runtimes' variables, and torch's pool if torch is
    loaded (a torch imported later reads the variables). Returns the count."""
    n = thread_count(role, cfg)
    os.environ.update({name: str(n) for name in _ENV})
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    return n
