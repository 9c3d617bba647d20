"""The checkpoints folder of a run: names, the complete checkpoints, the newest intact one, abandoned branches
set aside, and the old ones removed beyond --checkpoints_total_limit.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from sdxl_trainer.state.checkpoint_layout import ABANDONED_PREFIX, CHECKPOINT_NAME, TRAINER_STATE_FILE
from sdxl_trainer.state.verify import checkpoint_problem


def checkpoint_name(update: int) -> str:
    return f"update_{update:08d}"


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (by update number)."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match and (path / TRAINER_STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def find_latest_checkpoint(
    checkpoints_dir: Path, problem_of: Callable[[Path], str | None] = checkpoint_problem
) -> tuple[Path | None, dict[Path, str]]:
    """The newest intact checkpoint (None if there is none), and the newer damaged ones skipped, with why.
    `problem_of`: checkpoint_problem, or a collective check that also verifies the checksums."""
    skipped: dict[Path, str] = {}
    for path in reversed(complete_checkpoints(checkpoints_dir)):
        problem = problem_of(path)
        if problem is None:
            return path, skipped
        skipped[path] = problem
    return None, skipped


def set_aside_later_checkpoints(checkpoints_dir: Path, update: int) -> tuple[Path | None, list[Path]]:
    """Rank 0, when a run resumes from update `update`: move this folder's checkpoints of later updates (an
    abandoned branch) into `abandoned_after_update_<N>_<time>/`, so that --checkpoints_total_limit (which keeps
    the highest update numbers) and 'latest' mean the resumed run's checkpoints. Nothing is deleted.
    Returns the folder and what was moved into it (None, [] if nothing was later)."""
    if not checkpoints_dir.is_dir():
        return None, []
    later = sorted(path for path in checkpoints_dir.iterdir() if (match := CHECKPOINT_NAME.match(path.name)) and int(match.group(1)) > update)
    if not later:
        return None, []
    aside = checkpoints_dir / f"{ABANDONED_PREFIX}{checkpoint_name(update)}_{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    return aside, later


def checkpoint_update(path: Path) -> int:
    """The update number in a checkpoint folder's name (update_<N>)."""
    return int(CHECKPOINT_NAME.match(path.name).group(1))


def remove_old_checkpoints(checkpoints_dir: Path, keep: int, saved: Path | None = None) -> list[Path]:
    """Rank 0, after a save: delete all but the newest `keep` intact-looking checkpoints (keep 0 = keep all), and
    the `.tmp` folders of saves that died. Returns the deleted folders. Counted are the complete checkpoints that
    checkpoint_problem finds nothing wrong with, up to the update of `saved` (the save just made, never deleted):
    a damaged checkpoint is neither counted nor deleted (a damaged update_12 beside a new update_2 would
    otherwise outrank, and so delete, every new save), nor is one of a later update, no part of this run's line."""
    removed = [path for path in checkpoints_dir.glob("update_*.tmp") if path.is_dir()]
    if keep > 0:
        newest = checkpoint_update(saved) if saved is not None else None
        counted = [
            path for path in complete_checkpoints(checkpoints_dir)
            if (newest is None or checkpoint_update(path) <= newest) and checkpoint_problem(path) is None
        ]
        removed += counted[:-keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
