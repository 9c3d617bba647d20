"""Guards of a run folder (OUTPUT_DIR/PROJECT_NAME): one run at a time, and no silent start over a finished one.

Two runs in one folder delete each other's checkpoints (each keeps only its newest) and overwrite each
other's exports; a fresh start in the folder of a finished run replaces its model without a word.
"""

from __future__ import annotations

from pathlib import Path

from sdxl_trainer.runtime.files import LockHeld, ProcessLock
from sdxl_trainer.state.checkpoint import complete_checkpoints

RUN_LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder's lock; the message names it."""


class RunFolderLock(ProcessLock):
    """A ProcessLock on RUN/run.lock, held by rank 0 for the run's life."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / RUN_LOCK_FILE
        try:
            super().__init__(self.path)
        except LockHeld as held:
            raise RunFolderBusy(
                f"{run_dir} is in use by another run ({held}, which holds {self.path}): wait for it to end or stop it, "
                "or give this run another --project_name"
            ) from None


def earlier_run_outputs(run_dir: Path) -> list[Path]:
    """What an earlier run left in the folder that a fresh start would replace: its state checkpoints and
    exported models (pipeline, pipeline.safetensors, pipeline_epoch_NNNN)."""
    if not run_dir.is_dir():
        return []
    return complete_checkpoints(run_dir / "checkpoints") + sorted(run_dir.glob("pipeline*"))


def earlier_run_problems(run_dir: Path) -> list[str]:
    """A fresh start (no --load_saved_state) in the folder of an earlier run would replace its exported model
    and, through --checkpoints_total_limit, its checkpoints."""
    outputs = earlier_run_outputs(run_dir)
    if not outputs:
        return []
    names = ", ".join(str(path.relative_to(run_dir)) for path in outputs[:4]) + (f" and {len(outputs) - 4} more" if len(outputs) > 4 else "")
    return [
        f"{run_dir} holds an earlier run ({names}), which this fresh start would overwrite: continue it with --load_saved_state latest, "
        "start a new run with another --project_name, or start over in this folder with --overwrite_run"
    ]
