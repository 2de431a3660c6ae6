from common.proc import run_worker
from tokenizer_worker.worker import TokenizerWorker


def main(argv: list[str] | None = None) -> None:
    run_worker("tokenizer_worker", TokenizerWorker, argv)


if __name__ == "__main__":
    main()
