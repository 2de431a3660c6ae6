"""CUDA MPS for `voxpipe serve`: the gpu_worker and the codec_worker share a GPU without time slices.

Without MPS each process has its own CUDA context, and the GPU runs one context at a time: while
the codec_worker's pass runs, the LM's next step waits for its time slice, and the other way round.
Under MPS both processes' kernels go through one server and run side by side.

`--mps on` starts a private MPS control daemon (its pipe and log directories in the run directory),
hands its pipe directory to the GPU processes, and stops it when the server stops. `--mps auto`
does that when the control program (`nvidia-cuda-mps-control`, shipped with the NVIDIA driver) is on
PATH and the daemon starts, and serves without MPS otherwise. When `CUDA_MPS_PIPE_DIRECTORY` is already set, a daemon the
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
        environ = os.environ if environ is None else environ
        self.external = environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
        self.pipe_dir = self.external or os.path.join(run_dir, "mps-pipe")
        self.log_dir = environ.get("CUDA_MPS_LOG_DIRECTORY") or os.path.join(run_dir, "mps-log")
        self.binary = shutil.which(CONTROL, path=environ.get("PATH"))
        self.started = False

    @property
    def env(self) -> dict[str, str]:
        """What a GPU process's environment needs to become this daemon's client."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def _control(self, *args: str, stdin: str | None = None) -> None:
        assert self.binary is not None
        subprocess.run(
            [self.binary, *args],
            input=stdin,
            text=True,
            env={**os.environ, **self.env},
            check=True,
            timeout=20,
            capture_output=True,
        )

    def start(self) -> None:
        if self.external:
            log.info("MPS: using the daemon at %s", self.pipe_dir)
            return
        if self.binary is None:
            raise RuntimeError(f"--mps on: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            self._control("-d")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise RuntimeError(f"--mps: {CONTROL} -d failed: {detail.strip()}") from e
        self.started = True
        log.info("MPS: started a control daemon (pipe %s, log %s)", self.pipe_dir, self.log_dir)

    def stop(self) -> None:
        """Quit the daemon this server started (its server exits with it); a user's stays."""
        if not self.started:
            return
        self.started = False
        try:
            self._control(stdin="quit\n")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
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
