"""`python -m codec_worker` (or `voxpipe codec-worker`): the codec, binding the codec_in socket.

Settings from flags or VOXPIPE_* variables (`--help` lists them), or `--config-json` from
`voxpipe serve`.
"""

from codec_worker.worker import CodecWorker
from common.options import RoleSettings
from common.proc import run_worker


def main(argv: list[str] | None = None, settings: RoleSettings | None = None) -> None:
    run_worker("codec_worker", CodecWorker, argv, settings)


if __name__ == "__main__":
    main()
