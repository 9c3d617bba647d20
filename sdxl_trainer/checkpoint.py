"""Training state saved and restored as a whole through torch.distributed.checkpoint (DCP).

A checkpoint folder holds the DCP shards of every rank (UNet, optimizer state, EMA) and
`trainer_state.json` (counters, LR schedule, anything else plain). Tensors go through DCP, which writes
each rank's shards without gathering and can reshard on load; plain values go to JSON, never pickle.

All ranks write into a temporary folder; only after every rank has finished (a barrier) does rank 0
write trainer_state.json and rename the folder to its final name. So a folder without the `.tmp`
suffix is always complete, and a save that dies halfway never replaces an earlier checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .ema import ShardedEMA

TRAINER_STATE_FILE = "trainer_state.json"


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: ShardedEMA | None) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = ema.sharded_state_dict()
    return state


def save_training_state(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: ShardedEMA | None, trainer_state: dict[str, Any]
) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    tmp_dir = checkpoint_dir.with_name(checkpoint_dir.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a save that died
    dist.barrier()
    dcp.save(_tensor_state(model, optimizer, ema), checkpoint_id=str(tmp_dir))
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        state = dict(trainer_state, ema_updates=ema.updates if ema is not None else 0)
        (tmp_dir / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        if checkpoint_dir.exists():
            shutil.rmtree(checkpoint_dir)
        tmp_dir.rename(checkpoint_dir)
    dist.barrier()
    return checkpoint_dir


def load_training_state(checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: ShardedEMA | None) -> dict[str, Any]:
    """Collective: restore model, optimizer and EMA in place; returns trainer_state.json's values.
    (get_state_dict creates a fresh optimizer's state with a zero-learning-rate step, as DCP needs a template.)"""
    state_file = checkpoint_dir / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete checkpoint (no {TRAINER_STATE_FILE}); pick another one")
    trainer_state = json.loads(state_file.read_text(encoding="utf-8"))
    state = _tensor_state(model, optimizer, ema)
    dcp.load(state, checkpoint_id=str(checkpoint_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ema is not None:
        ema.load_sharded_state_dict(state["ema"], trainer_state["ema_updates"])
    return trainer_state
