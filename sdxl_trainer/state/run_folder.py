"""Guards of a run folder (OUTPUT_DIR/PROJECT_NAME): one run at a time, no silent start over an earlier one,
and --overwrite_run's start over.

Two runs in one folder delete each other's checkpoints (each keeps only its newest) and overwrite each
other's exports; a start that does not continue the folder's run (a fresh one, 'latest' finding no
checkpoint, a checkpoint of another folder) replaces its model without a word.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from sdxl_trainer.runtime.files import LockHeld, ProcessLock
from sdxl_trainer.state.checkpoint_layout import ABANDONED_PREFIX, CHECKPOINT_NAME
from sdxl_trainer.state.checkpoints_folder import complete_checkpoints

RUN_LOCK_FILE = "run.lock"
OVERWRITTEN_PREFIX = "overwritten_"  # + the time: where --overwrite_run moves an earlier run's exports and logs


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


def earlier_exports(run_dir: Path) -> list[Path]:
    """The exported models in the folder: pipeline, pipeline.safetensors, pipeline_epoch_NNNN(.safetensors)."""
    return sorted(run_dir.glob("pipeline*")) if run_dir.is_dir() else []


def earlier_run_outputs(run_dir: Path) -> list[Path]:
    """What an earlier run left in the folder that a start which does not continue it would replace: its state
    checkpoints (damaged ones too) and exported models."""
    return complete_checkpoints(run_dir / "checkpoints") + earlier_exports(run_dir)


def continues_run(run_dir: Path, checkpoint: Path | None) -> bool:
    """Whether resuming from `checkpoint` continues the folder's run: it is one of the folder's checkpoints (a
    branch set aside by going back included)."""
    return checkpoint is not None and checkpoint.resolve().is_relative_to((run_dir / "checkpoints").resolve())


def earlier_run_problems(run_dir: Path, load_saved_state: str | None = None, resume_dir: Path | None = None) -> list[str]:
    """A start that does not continue the folder's run (no --load_saved_state, 'latest' finding no checkpoint,
    `resume_dir` of another folder) would replace its exported models and, through --checkpoints_total_limit,
    its checkpoints."""
    if continues_run(run_dir, resume_dir):
        return []
    outputs = earlier_run_outputs(run_dir)
    if not outputs:
        return []
    names = ", ".join(str(path.relative_to(run_dir)) for path in outputs[:4]) + (f" and {len(outputs) - 4} more" if len(outputs) > 4 else "")
    overwrite = "start over in this folder with --overwrite_run"
    if load_saved_state is None:
        return [
            f"{run_dir} holds an earlier run ({names}), which this fresh start would overwrite: continue it with --load_saved_state latest, "
            f"start a new run with another --project_name, or {overwrite}"
        ]
    if resume_dir is None:  # 'latest' found no checkpoint, so `outputs` are exports (every checkpoint damaged is find_resume_checkpoint's refusal)
        return [
            f"{run_dir} holds an earlier run ({names}) but no checkpoint to continue it from, so --load_saved_state latest would start "
            f"from the base model and overwrite it: give this run another --project_name, or {overwrite} in place of --load_saved_state "
            f"(to fine-tune on from its export, pass --pretrained_model_name_or_path {outputs[0]} with another --project_name)"
        ]
    go_on = "continue it with --load_saved_state latest, " if complete_checkpoints(run_dir / "checkpoints") else ""
    return [
        f"{run_dir} holds an earlier run ({names}), which starting from {resume_dir} (a checkpoint of another run folder) would overwrite: "
        f"{go_on}give this run another --project_name, or {overwrite} (keeping --load_saved_state {resume_dir})"
    ]


def _size_text(paths: list[Path]) -> str:
    size = sum(file.stat().st_size for path in paths for file in ([path] if path.is_file() else path.rglob("*")) if file.is_file())
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def start_over(run_dir: Path, earlier_results: list[Path], delete_abandoned: bool) -> list[str]:
    """Rank 0, --overwrite_run: delete the earlier run's checkpoints (those set aside by going back only with
    `delete_abandoned`: resuming promised to delete nothing), and move `earlier_results` (its exports, event
    files, sample grid...; those not there are skipped) into one OVERWRITTEN_PREFIX<time> folder, a path inside
    the run folder keeping its place below it, one outside under its folder's name. Returns what it says,
    naming every folder deleted or moved."""
    messages = []
    checkpoints_dir = run_dir / "checkpoints"
    if checkpoints_dir.is_dir():
        entries = sorted(checkpoints_dir.iterdir())
        checkpoints = [path for path in entries if CHECKPOINT_NAME.match(path.name.removesuffix(".tmp"))]
        abandoned = [path for path in entries if path.name.startswith(ABANDONED_PREFIX)]
        deleted = checkpoints + (abandoned if delete_abandoned else [])
        for path in deleted:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        if deleted:
            messages.append(f"--overwrite_run: deleted the earlier run's checkpoints in {checkpoints_dir}: {', '.join(path.name for path in deleted)}.")
        if abandoned and not delete_abandoned:
            messages.append(
                f"--overwrite_run: kept {', '.join(path.name for path in abandoned)} in {checkpoints_dir} (checkpoints set aside by going "
                "back; not this run's: the limit and 'latest' leave them alone). Delete them by hand, or add --delete_abandoned_branches."
            )
    moved = [path for path in earlier_results if path.exists()]
    if moved:
        aside = run_dir / f"{OVERWRITTEN_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
        size = _size_text(moved)
        names = []
        for path in moved:
            name = path.relative_to(run_dir) if path.is_relative_to(run_dir) else Path(path.parent.name) / path.name
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, aside / name)
            names.append(name.as_posix())
        messages.append(
            f"--overwrite_run: moved the earlier run's exports and logs into {aside} ({size}; delete it once you no longer need them): "
            f"{', '.join(names)}."
        )
    return messages
