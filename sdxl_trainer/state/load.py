"""Resuming: a checkpoint's tensors, RNG states and counters restored in place, after checking it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.numpy import load_file as load_numpy_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from sdxl_trainer.runtime.files import write_error_reason
from sdxl_trainer.state.checkpoint_layout import DATA_POSITION_FILE, CheckpointError
from sdxl_trainer.state.dcp_json_index import JsonIndexReader
from sdxl_trainer.state.rng_states import restore_rng_states, rng_file
from sdxl_trainer.state.save import Stateful, tensor_state
from sdxl_trainer.state.trainer_state import TrainerState, read_trainer_state
from sdxl_trainer.state.verify import checkpoint_problem


def load_training_state(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Stateful | None
) -> tuple[TrainerState, dict[str, Any]]:
    """Collective: restore model, optimizer state, EMA and this rank's RNG states in place; returns
    trainer_state.json's values and the data position's state (DataPosition.from_state_dict rebuilds it). The
    optimizer's hyperparameters stay this run's.
    (get_state_dict creates a fresh optimizer's state with a zero-learning-rate step, as DCP needs a template.)
    A rank with no saved RNG state (the run now has more processes) keeps its own seeded RNG."""
    problem = checkpoint_problem(checkpoint_dir)
    if problem:
        raise CheckpointError(f"Cannot resume from {checkpoint_dir}: {problem}")
    trainer_state = read_trainer_state(checkpoint_dir)
    state = tensor_state(model, optimizer, ema)
    try:
        dcp.load(state, storage_reader=JsonIndexReader(checkpoint_dir))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP wraps every rank's read error
        raise CheckpointError(
            f"Cannot resume from {checkpoint_dir}: its tensors could not be read ({write_error_reason(error)}). "
            "The checkpoint is damaged or does not fit this model: resume from another one (--load_saved_state latest skips damaged ones)."
        ) from (error if isinstance(error, Exception) else None)
    # The optimizer's state is loaded by now: DCP wrote into the live tensors get_state_dict returned. Handing
    # it to the optimizer's load_state_dict again would cast every floating state tensor to its parameter's
    # dtype: the fp32 moments of bf16 weights (--weights_dtype bf16) would come back rounded to bf16.
    set_model_state_dict(model, state["model"])
    if ema is not None:
        ema.load_state_dict({"weights": state["ema"], "updates": trainer_state.ema_updates})
    states_file = rng_file(checkpoint_dir, dist.get_rank())
    if states_file.is_file():
        restore_rng_states(states_file)
    arrays = load_numpy_file(str(checkpoint_dir / DATA_POSITION_FILE))
    return trainer_state, {"epoch": trainer_state.epoch, "updates_in_epoch": trainer_state.updates_in_epoch, **arrays}
