from codec_worker.worker import CodecWorker
from common.proc import run_worker


def main(argv: list[str] | None = None) -> None:
    run_worker("codec_worker", CodecWorker, argv)


if __name__ == "__main__":
    main()
