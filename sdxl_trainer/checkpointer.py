"""When the training state is saved, and one policy for a save that fails.

Saves are due after every --save_state_every_n_updates updates, at epoch saves, when a stop is requested,
when updates keep failing, and at the end. A save that fails (a full disk) never touches the earlier
checkpoints; what happens next depends on whether training goes on:
- while it goes on (scheduled and epoch saves): a warning, and training goes on;
- when the run is about to end (stop request, NaN stop, the end): CheckpointError, which ends the job
  with its message (at the end only after the model is exported).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch import nn

from .checkpoint import (
    CheckpointError,
    DataPosition,
    TrainerState,
    checkpoint_name,
    remove_old_checkpoints,
    save_training_state,
)
from .train_step import TrainStep


@dataclass(frozen=True)
class SavePolicy:
    enabled: bool  # --save_state
    every_n_updates: int  # 0 = off
    keep: int  # --checkpoints_total_limit (0 = all)


class Checkpointer:
    def __init__(self, checkpoints_dir: Path, policy: SavePolicy, model: nn.Module, train_step: TrainStep, run_facts: Callable[[], dict],
                 report: Callable[[str], None], last_saved_update: int | None):
        """`model`: what the checkpoint holds with the optimizer state (TrainedModels.checkpointed); `run_facts`
        gives the TrainerState fields the train step does not know (seed, optimizer, batch...); `report`
        prints a message once (rank 0)."""
        self.checkpoints_dir = checkpoints_dir
        self.model = model
        self.policy = policy
        self.train_step = train_step
        self.run_facts = run_facts
        self.report = report
        self.last_saved_update = last_saved_update
        self.last_saved_dir: Path | None = None

    def save(self, position: DataPosition) -> Path:
        """Collective: save now, then keep the newest checkpoints. Raises CheckpointError on every rank."""
        state = TrainerState(
            **self.train_step.state_dict(),
            **self.run_facts(),
            epoch=position.epoch,
            updates_in_epoch=position.updates_in_epoch,
            ema_updates=self.train_step.ema.updates if self.train_step.ema is not None else 0,
            world_size=dist.get_world_size(),
        )
        started = time.perf_counter()
        step = self.train_step
        checkpoint_dir = save_training_state(self.checkpoints_dir / checkpoint_name(state.update), self.model, step.optimizer, step.ema, state, position)
        self.last_saved_update, self.last_saved_dir = state.update, checkpoint_dir
        if dist.get_rank() == 0:
            removed = remove_old_checkpoints(self.checkpoints_dir, self.policy.keep)
            self.report(f"Saved state to {checkpoint_dir} in {time.perf_counter() - started:.1f} s" + (f"; removed {len(removed)} older" if removed else "") + ".")
        return checkpoint_dir

    def _save_or_warn(self, position: DataPosition) -> None:
        try:
            self.save(position)
        except CheckpointError as error:
            self.report(f"Warning: {error} Training goes on.")

    @property
    def _unsaved(self) -> bool:
        return self.policy.enabled and self.last_saved_update != self.train_step.updates_done

    def after_update(self, position: DataPosition) -> None:
        every = self.policy.every_n_updates
        if self.policy.enabled and every and self.train_step.updates_done % every == 0:
            self._save_or_warn(position)

    def at_epoch_save(self, position: DataPosition) -> None:
        if self._unsaved:
            self._save_or_warn(position)

    def before_exit(self, position: DataPosition, even_without_save_state: bool = False) -> Path | None:
        """Save the state of a run that ends now unless it is saved already; returns the newest checkpoint.
        Raises CheckpointError. A stop request or a NaN stop saves even with --no-save_state: the run is cut short."""
        if self.last_saved_update != self.train_step.updates_done and (self.policy.enabled or even_without_save_state):
            self.save(position)
        return self.last_saved_dir
