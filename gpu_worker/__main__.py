from common.proc import run_worker
from gpu_worker.worker import GpuWorker


def main(argv: list[str] | None = None) -> None:
    run_worker("gpu_worker", GpuWorker, argv)


if __name__ == "__main__":
    main()
