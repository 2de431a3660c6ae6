"""`python -m tokenizer_worker` (or `voxpipe tokenizer`): one prompt builder of the pool.

Settings from flags or VOXPIPE_* variables (`--help` lists them), or `--config-json` from
`voxpipe serve`. Start as many as you like, at any time; SIGTERM makes one leave without losing work.
"""

from common.options import RoleSettings
from common.proc import run_worker
from tokenizer_worker.worker import TokenizerWorker


def main(argv: list[str] | None = None, settings: RoleSettings | None = None) -> None:
    run_worker("tokenizer_worker", TokenizerWorker, argv, settings)


if __name__ == "__main__":
    main()
