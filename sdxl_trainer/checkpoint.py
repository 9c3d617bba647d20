"""Training state saved and restored as a whole through torch.distributed.checkpoint (DCP).

A checkpoint folder `checkpoints/update_<N>` holds:
- the DCP shards of every rank: UNet, optimizer state (torchao's 8-bit state included) and EMA. DCP
  writes each rank's shards without gathering and reshards on load (a run saved on 2 processes resumes
  on 1 or 4). Its index is written as JSON (`.metadata.json`) instead of DCP's default pickle, so
  opening a checkpoint never runs code; tensor files are read with torch.load(weights_only=True);
- `rng/rank<R>.safetensors`: every rank's torch / CUDA / numpy / Python RNG states;
- `data_position.safetensors`: where the run is inside its epoch (items carried into the epoch and
  items already trained on), so a resume continues the epoch instead of replaying it;
- `trainer_state.json`, written last: counters, LR schedule, loss scaler, and the facts a resume checks.

Crash safety: all ranks write into `update_<N>.tmp`; only after every rank reports success does rank 0
write trainer_state.json and rename the folder. A folder without `.tmp` that holds trainer_state.json is
complete; a save that dies halfway (killed, disk full) never touches the earlier checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.numpy import load_file as load_numpy_file
from safetensors.numpy import save_file as save_numpy_file
from torch import nn
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .ema import ShardedEMA

TRAINER_STATE_FILE = "trainer_state.json"
DATA_POSITION_FILE = "data_position.safetensors"
METADATA_FILE = ".metadata.json"
CHECKPOINT_NAME = re.compile(r"^update_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what to do."""


# ---- DCP with a JSON index ------------------------------------------------------------------------


def _metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    entries = {}
    for fqn, storage in metadata.state_dict_metadata.items():
        if isinstance(storage, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
            continue
        if storage.properties.layout != torch.strided:
            raise CheckpointError(f"{fqn}: only strided tensors can be checkpointed, got {storage.properties.layout}")
        entries[fqn] = {
            "dtype": str(storage.properties.dtype).removeprefix("torch."),
            "requires_grad": storage.properties.requires_grad,
            "size": list(storage.size),
            "chunks": [[list(chunk.offsets), list(chunk.sizes)] for chunk in storage.chunks],
        }
    storage_data = [
        {
            "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "index": index.index,
            "path": info.relative_path,
            "start": info.offset,
            "length": info.length,
            "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
        }
        for index, info in metadata.storage_data.items()
    ]
    meta = metadata.storage_meta or StorageMeta()
    return {
        "version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": {fqn: list(path) for fqn, path in (metadata.planner_data or {}).items()},
        "storage_data": storage_data,
        "storage_meta": {"checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id), "save_id": meta.save_id, "modules": meta.modules},
    }


def _metadata_from_json(data: dict[str, Any]) -> Metadata:
    entries: dict[str, Any] = {}
    for fqn, entry in data["state_dict_metadata"].items():
        if entry.get("bytes"):
            entries[fqn] = BytesStorageMetadata()
            continue
        properties = TensorProperties(dtype=getattr(torch, entry["dtype"]), requires_grad=entry["requires_grad"])
        chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in entry["chunks"]]
        entries[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
    storage_data = {
        MetadataIndex(item["fqn"], item["offset"], item["index"]): _StorageInfo(item["path"], item["start"], item["length"], item["transforms"])
        for item in data["storage_data"]
    }
    meta = data["storage_meta"]
    return Metadata(
        state_dict_metadata=entries,
        planner_data={fqn: tuple(path) for fqn, path in data["planner_data"].items()},
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"], modules=meta["modules"]),
        version=data["version"],
    )


class JsonIndexWriter(FileSystemWriter):
    """DCP's file writer, with the checkpoint index written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
        metadata.storage_meta = self.storage_meta()
        final_path = Path(self.path) / METADATA_FILE
        tmp_path = final_path.with_name(final_path.name + ".tmp")
        with open(tmp_path, "w", encoding="utf-8") as index_file:
            json.dump(_metadata_to_json(metadata), index_file)
            index_file.flush()
            os.fsync(index_file.fileno())
        tmp_path.replace(final_path)


class JsonIndexReader(FileSystemReader):
    """Reads checkpoints written by JsonIndexWriter."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _metadata_from_json(json.loads((Path(self.path) / METADATA_FILE).read_text(encoding="utf-8")))
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- per-rank RNG states ----------------------------------------------------------------------------


def _rng_file(checkpoint_dir: Path, rank: int) -> Path:
    return checkpoint_dir / "rng" / f"rank{rank}.safetensors"


def _save_rng_states(path: Path) -> None:
    algorithm, numpy_keys, numpy_position, has_gauss, cached_gauss = np.random.get_state()
    python_version, python_state, python_gauss = random.getstate()
    arrays = {
        "torch": torch.get_rng_state().numpy(),
        "numpy_keys": np.asarray(numpy_keys, dtype=np.uint32),
        "python_state": np.asarray(python_state, dtype=np.uint64),
    }
    if torch.cuda.is_available():
        arrays["torch_cuda"] = torch.cuda.get_rng_state().numpy()
    details = {"numpy": [algorithm, int(numpy_position), int(has_gauss), float(cached_gauss)], "python": [python_version, python_gauss]}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_numpy_file(arrays, str(path), metadata={"details": json.dumps(details)})


def _restore_rng_states(path: Path) -> None:
    from safetensors import safe_open

    arrays = load_numpy_file(str(path))
    with safe_open(str(path), framework="numpy") as handle:
        details = json.loads(handle.metadata()["details"])
    torch.set_rng_state(torch.from_numpy(arrays["torch"]))
    if "torch_cuda" in arrays and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(arrays["torch_cuda"]))
    algorithm, position, has_gauss, cached_gauss = details["numpy"]
    np.random.set_state((algorithm, arrays["numpy_keys"], position, has_gauss, cached_gauss))
    python_version, python_gauss = details["python"]
    random.setstate((python_version, tuple(int(value) for value in arrays["python_state"]), python_gauss))


# ---- save and load ----------------------------------------------------------------------------------


@dataclass
class DataPosition:
    """Where training stands in the data: the epoch to continue, how many optimizer updates of it are done,
    the items carried into it from the previous epoch, and the items it has already trained on."""

    epoch: int
    updates_in_epoch: int
    carried_in: np.ndarray
    consumed: np.ndarray

    @classmethod
    def epoch_start(cls, epoch: int, carried_in: np.ndarray | None = None) -> DataPosition:
        nothing = np.zeros(0, dtype=np.int64)
        return cls(epoch, 0, nothing if carried_in is None else carried_in, nothing)


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: ShardedEMA | None) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = ema.sharded_state_dict()
    return state


def _plain_number(value: Any) -> Any:
    """JSON for the one-element tensors some optimizers keep as hyperparameters (torchao's lr)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to {TRAINER_STATE_FILE}")


def _all_ranks_succeeded(succeeded: bool) -> bool:
    flag = torch.tensor([1 if succeeded else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_training_state(
    checkpoint_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: ShardedEMA | None,
    trainer_state: dict[str, Any],
    position: DataPosition | None = None,
    writer_factory: Callable[[Path], FileSystemWriter] = JsonIndexWriter,
) -> Path:
    """Collective: every rank calls it. Returns the final folder, or raises CheckpointError on every rank
    (after removing the partial folder) when any rank failed to write; earlier checkpoints are untouched."""
    tmp_dir = checkpoint_dir.with_name(checkpoint_dir.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a save that died
    dist.barrier()
    error: BaseException | None = None
    try:
        dcp.save(_tensor_state(model, optimizer, ema), storage_writer=writer_factory(tmp_dir))
        _save_rng_states(_rng_file(tmp_dir, rank))
        if rank == 0 and position is not None:
            save_numpy_file(
                {"carried_in": position.carried_in.astype(np.int64), "consumed": position.consumed.astype(np.int64)},
                str(tmp_dir / DATA_POSITION_FILE),
            )
    except Exception as caught:  # noqa: BLE001 - every rank must learn of a failure on any rank
        error = caught
    if _all_ranks_succeeded(error is None) and rank == 0:
        try:
            state = dict(trainer_state, ema_updates=ema.updates if ema is not None else 0, world_size=dist.get_world_size())
            if position is not None:
                state.update(epoch=position.epoch, updates_in_epoch=position.updates_in_epoch)
            (tmp_dir / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2, default=_plain_number) + "\n", encoding="utf-8")
            if checkpoint_dir.exists():
                shutil.rmtree(checkpoint_dir)
            tmp_dir.rename(checkpoint_dir)
        except Exception as caught:  # noqa: BLE001
            error = caught
    if not _all_ranks_succeeded(error is None):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        reason = f"{type(error).__name__}: {error}" if error is not None else "another process failed to write its part"
        advice = (
            "Free disk space (a checkpoint takes the UNet's fp32 size x 3 with adamw, x 1.5 with adamw8bit, "
            "plus x 1 with --use_ema: about 16 GB for SDXL with adamw8bit) or point --output_dir elsewhere."
            if error is None or isinstance(error, OSError)
            else "This is a bug: please report it with this message."
        )
        raise CheckpointError(f"Could not save a checkpoint to {checkpoint_dir} ({reason}). Earlier checkpoints are untouched. {advice}") from error
    return checkpoint_dir


def read_trainer_state(checkpoint_dir: Path) -> dict[str, Any]:
    state_file = checkpoint_dir / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint (no {TRAINER_STATE_FILE}): pick another one, or --load_saved_state latest")
    return json.loads(state_file.read_text(encoding="utf-8"))


def load_training_state(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: ShardedEMA | None
) -> tuple[dict[str, Any], DataPosition | None]:
    """Collective: restore model, optimizer, EMA and this rank's RNG states in place; returns
    trainer_state.json's values and the data position (None if the checkpoint has none).
    (get_state_dict creates a fresh optimizer's state with a zero-learning-rate step, as DCP needs a template.)
    A rank with no saved RNG state (the run now has more processes) keeps its own seeded RNG."""
    trainer_state = read_trainer_state(checkpoint_dir)
    state = _tensor_state(model, optimizer, ema)
    dcp.load(state, storage_reader=JsonIndexReader(checkpoint_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ema is not None:
        ema.load_sharded_state_dict(state["ema"], trainer_state["ema_updates"])
    rng_file = _rng_file(checkpoint_dir, dist.get_rank())
    if rng_file.is_file():
        _restore_rng_states(rng_file)
    position = None
    if (checkpoint_dir / DATA_POSITION_FILE).is_file():
        arrays = load_numpy_file(str(checkpoint_dir / DATA_POSITION_FILE))
        position = DataPosition(trainer_state["epoch"], trainer_state["updates_in_epoch"], arrays["carried_in"], arrays["consumed"])
    return trainer_state, position


# ---- the checkpoints folder --------------------------------------------------------------------------


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


def find_latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    checkpoints = complete_checkpoints(checkpoints_dir)
    return checkpoints[-1] if checkpoints else None


def remove_old_checkpoints(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Rank 0: delete all but the newest `keep` complete checkpoints (keep 0 = keep all), and the
    `.tmp` folders of saves that died. Returns the deleted folders."""
    removed = [path for path in checkpoints_dir.glob("update_*.tmp") if path.is_dir()]
    checkpoints = complete_checkpoints(checkpoints_dir)
    if keep > 0:
        removed += checkpoints[:-keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
