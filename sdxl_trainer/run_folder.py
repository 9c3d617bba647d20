"""Guards of a run folder (OUTPUT_DIR/PROJECT_NAME): one run at a time, and no silent start over a finished one.

Two runs in one folder delete each other's checkpoints (each keeps only its newest) and overwrite each
other's exports; a fresh start in the folder of a finished run replaces its model without a word.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .checkpoint import complete_checkpoints

RUN_LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder's lock; the message names it."""


class RunFolderLock:
    """An flock on RUN/run.lock, held by rank 0 for the run's life. The kernel releases it when the process
    ends however it ends, so a killed run never leaves a stale lock (on NFS this needs its lock service,
    which NFSv4 has). The file names its holder, for the message a second run gets."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / RUN_LOCK_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "another process"
            self._handle.close()
            raise RunFolderBusy(
                f"{run_dir} is in use by another run ({holder}, which holds {self.path}): wait for it to end or stop it, "
                "or give this run another --project_name"
            ) from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self._handle.flush()

    def release(self) -> None:
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()


def earlier_run_outputs(run_dir: Path) -> list[Path]:
    """What an earlier run left in the folder that a fresh start would replace: its state checkpoints and
    exported models (pipeline, pipeline.safetensors, pipeline_epoch_NNNN)."""
    if not run_dir.is_dir():
        return []
    return complete_checkpoints(run_dir / "checkpoints") + sorted(run_dir.glob("pipeline*"))
