"""CUDA MPS for `voxpipe serve`: the gpu_worker and the codec_worker share a GPU without time slices.

Without MPS each process has its own CUDA context, and the GPU runs one context at a time: while
the codec_worker's pass runs, the LM's next step waits for its time slice, and the other way round.
Under MPS both processes' kernels go through one server and run side by side.

`--mps on` starts a private MPS control daemon (its pipe and log directories in the run directory),
hands its pipe directory to the GPU processes, and stops it when the server stops. `--mps auto`
does that when the control program (`nvidia-cuda-mps-control`, shipped with the NVIDIA driver) is on
PATH, the daemon starts and a CUDA client works under it (a probe process, a few seconds), and
serves without MPS otherwise. When `CUDA_MPS_PIPE_DIRECTORY` is already set, a daemon the
user runs is behind it: it is used as it is and left running.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("voxpipe.serve")

CONTROL = "nvidia-cuda-mps-control"
MODES = ("off", "on", "auto")
GPU_ROLES = ("gpu_worker", "codec_worker")


class MpsDaemon:
    """One MPS control daemon for this server's GPU processes (or the user's, when one is set)."""

    def __init__(self, run_dir: str, environ: dict[str, str] | None = None) -> None:
        environ = dict(os.environ if environ is None else environ)
        self.external = environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
        run_dir = os.path.abspath(run_dir)  # the daemon changes directory: no relative paths
        self.pipe_dir = self.external or os.path.join(run_dir, "mps-pipe")
        # A user's daemon logs where they said (or its default); ours in the run directory.
        self.log_dir = environ.get(
            "CUDA_MPS_LOG_DIRECTORY", "" if self.external else os.path.join(run_dir, "mps-log")
        )
        self.binary = shutil.which(CONTROL, path=environ.get("PATH"))
        self.base_env = {k: v for k, v in environ.items() if k != "VOXPIPE_API_KEY"}
        self.started = False

    @property
    def env(self) -> dict[str, str]:
        """What a GPU process's environment needs to become this daemon's client."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir}
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        return env

    def _control(self, *args: str, stdin: str | None = None) -> None:
        """Run the control program. Its output goes to a file, not a pipe: `-d` forks the daemon,
        which may keep inherited descriptors open, and a pipe would then never reach EOF."""
        assert self.binary is not None
        with open(os.path.join(self.log_dir, "control.out"), "a+") as out:
            start = out.tell()
            try:
                subprocess.run(
                    [self.binary, *args],
                    input=stdin,
                    text=True,
                    env={**self.base_env, **self.env},
                    check=True,
                    timeout=20,
                    stdout=out,
                    stderr=out,
                    stdin=None if stdin is not None else subprocess.DEVNULL,
                )
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
                out.seek(start)
                detail = out.read().strip() or str(e)
                raise RuntimeError(f"{CONTROL} {' '.join(args) or 'quit'} failed: {detail}") from e

    def start(self) -> None:
        if self.external:
            log.info("MPS: using the daemon at %s", self.pipe_dir)
            return
        if self.binary is None:
            raise RuntimeError(f"--mps on: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self.started = True  # from here on stop() quits it, whatever start() says
        try:
            self._control("-d")
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"--mps: {e}") from e
        log.info("MPS: started a control daemon (pipe %s, log %s)", self.pipe_dir, self.log_dir)

    def check(self, probe: list[str], timeout_s: float = 120.0) -> None:
        """Run `probe` (a command that touches the GPU) as the daemon's client: the daemon may
        start while its server cannot (compute mode, a container, another user's server), and that
        shows only when a client first uses CUDA. Raises RuntimeError with what the probe said."""
        try:
            r = subprocess.run(
                probe,
                env={**self.base_env, **self.env},
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except (subprocess.TimeoutExpired, OSError) as e:
            raise RuntimeError(f"MPS: a CUDA client could not start under the daemon: {e}") from e
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"MPS: a CUDA client could not start under the daemon: {tail[0]}")

    def stop(self) -> None:
        """Quit the daemon this server started (its server exits with it); a user's stays."""
        if not self.started:
            return
        self.started = False
        try:
            self._control(stdin="quit\n")
        except RuntimeError as e:
            log.warning("MPS: quitting the control daemon failed: %s", e)


def mps_for(mode: str, run_dir: str, environ: dict[str, str] | None = None) -> MpsDaemon | None:
    """The daemon `--mps MODE` asks for, not started yet; None when the server runs without MPS."""
    if mode not in MODES:
        raise ValueError(f"--mps must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    daemon = MpsDaemon(run_dir, environ)
    if mode == "auto" and daemon.binary is None and not daemon.external:
        log.info("MPS: %s not found; the GPU processes share the GPU by time slices", CONTROL)
        return None
    return daemon
