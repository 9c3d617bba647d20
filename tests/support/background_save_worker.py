"""Run under torchrun by test_background_save.py: the trainer's Checkpointer saving in the background over the
tiny UNet (2 processes, 8-bit AdamW, an EMA), in one of three modes, each writing `<mode>.safetensors` (rank 0)
with the full weights after its last update:
- `straight`: updates 1-4, a background save after update 2 (written while updates 3 and 4 train);
- `killed`: updates 1-2, a background save after update 2 and its wait; update 3, then a background save whose
  writer process kills rank 1's training process (SIGKILL, and so itself) once its shards are written, while
  update 4 trains;
- `resumed`: `latest` from the checkpoints folder, then the updates after it up to 4."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from reshard_worker import fresh
from safetensors.torch import save_file
from train_step_worker import full_weights, rank_batch

from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.state.checkpointer import Checkpointer, CheckpointOptions, RunFacts
from sdxl_trainer.state.checkpoints_folder import find_latest_checkpoint
from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.training.stream import DataPosition

UPDATES = 4


class KillingWriter(JsonIndexWriter):
    """In rank 1's writer process: kills its training process (which takes the writer with it) after its shards
    are written, before the checkpoint is finished."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if os.environ.get("RANK") == "1":
            os.kill(os.getppid(), signal.SIGKILL)
            signal.pause()  # until the parent's death signal
        return written


def main(mode: str, pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    output = Path(output_dir)
    unet, optimizer, ema, step = fresh("adamw8bit", Path(pipeline_dir), world)
    first = 0
    if mode == "resumed":
        latest, _ = find_latest_checkpoint(output / "checkpoints")
        saved, _ = load_training_state(latest, unet, optimizer, ema)
        step.load_state_dict(saved.__dict__)
        first = saved.update
    facts = RunFacts("adamw8bit", "fp32", True, False, "", 2 * world.world_size, 1)
    options = CheckpointOptions(save_state=True, save_state_every_n_updates=0, checkpoints_total_limit=0)

    def checkpointer(writer=JsonIndexWriter) -> Checkpointer:
        return Checkpointer(output / "checkpoints", options, unet, optimizer, ema, step, facts, seed=3, report=print, last_saved_update=None,
                            writer_factory=writer)

    saving, killing = checkpointer(), checkpointer(KillingWriter)
    for update in range(first, UPDATES):
        step(rank_batch(unet, world, update), epoch=0)
        position = DataPosition(0, update + 1, DataPosition.epoch_start(0).carried_in, DataPosition.epoch_start(0).consumed)
        if mode != "resumed" and update + 1 == 2:
            saving.save_in_background(position)
            if mode == "killed":
                saving.wait()
        if mode == "killed" and update + 1 == 3:
            killing.save_in_background(position)
    saving.wait()
    killing.wait()  # the kill happens: a process that reached its end first would exit before its writer got there
    weights = full_weights(unet)
    if world.is_main:
        save_file({key: value.contiguous() for key, value in weights.items()}, output / f"{mode}.safetensors")
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
