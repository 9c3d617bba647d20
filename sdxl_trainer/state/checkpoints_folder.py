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


def intact_checkpoints(checkpoints_dir: Path, through_update: int | None = None) -> list[Path]:
    """The complete checkpoints checkpoint_problem finds nothing wrong with, oldest first; with through_update,
    only those of that update and before."""
    return [
        path for path in complete_checkpoints(checkpoints_dir)
        if (through_update is None or checkpoint_update(path) <= through_update) and checkpoint_problem(path) is None
    ]


def last_checkpoint_before_streak(checkpoints: list[Path], streak_start: int) -> Path | None:
    """Of `checkpoints` (oldest first), the newest whose weights an update that stepped started from: saved before
    update streak_start - 1. Skipped updates change no weight, so the streak of skipped updates starting at
    streak_start started from the weights of update streak_start - 1, which its checkpoint and every later one hold:
    weights that gave a NaN/inf loss or gradient (an update with a finite loss can blow weights up)."""
    before = [path for path in checkpoints if checkpoint_update(path) < streak_start - 1]
    return before[-1] if before else None


def remove_old_checkpoints(checkpoints_dir: Path, keep: int, saved: Path | None = None, streak_start: int | None = None) -> list[Path]:
    """Rank 0, after a save: delete all but the newest `keep` intact-looking checkpoints (keep 0 = keep all), and
    the `.tmp` folders of saves that died. Returns the deleted folders. Counted are the complete checkpoints that
    checkpoint_problem finds nothing wrong with, up to the update of `saved` (the save just made, never deleted):
    a damaged checkpoint is neither counted nor deleted (a damaged update_12 beside a new update_2 would
    otherwise outrank, and so delete, every new save), nor is one of a later update, no part of this run's line.
    `streak_start`: `saved` was made in a streak of skipped updates that began at this update; the last checkpoint
    from before the weights the streak started from (last_checkpoint_before_streak) is kept besides the newest
    `keep`, so saves of a run that diverged never rotate its last good checkpoint out."""
    removed = [path for path in checkpoints_dir.glob("update_*.tmp") if path.is_dir()]
    if keep > 0:
        counted = intact_checkpoints(checkpoints_dir, checkpoint_update(saved) if saved is not None else None)
        good = last_checkpoint_before_streak(counted, streak_start) if streak_start is not None else None
        removed += [path for path in counted[:-keep] if path != good]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
