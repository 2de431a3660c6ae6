"""`python -m gpu_worker` (or `voxpipe gpu-worker`): the LM engine, binding the gpu_in socket.

Settings from flags or VOXPIPE_* variables (`--help` lists them), or `--config-json` from
`voxpipe serve`.
"""

from common.options import RoleSettings
from common.proc import run_worker
from gpu_worker.worker import GpuWorker


def main(argv: list[str] | None = None, settings: RoleSettings | None = None) -> None:
    run_worker("gpu_worker", GpuWorker, argv, settings)


if __name__ == "__main__":
    main()
