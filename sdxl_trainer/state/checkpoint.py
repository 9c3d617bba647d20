"""Training state saved and restored as a whole through torch.distributed.checkpoint (DCP).

A checkpoint folder `checkpoints/update_<N>` holds:
- the DCP shards of every rank: UNet, optimizer state (torchao's 8-bit state included) and EMA. DCP
  writes each rank's shards without gathering and reshards on load (a run saved on 2 processes resumes
  on 1 or 4);
- `rng/rank<R>.safetensors`: every rank's torch / CUDA / numpy / Python RNG states;
- `data_position.safetensors`: where the run is inside its epoch (items carried into the epoch and
  items already trained on), so a resume continues the epoch instead of replaying it;
- `trainer_state.json`: counters, loss scaler, and the facts a resume checks;
- `checksums.json`, written last: the SHA-256 of every other file, trainer_state.json included (each rank
  hashing the files it wrote); a resume checks them (each rank its share of the files), so a shard, a
  counter or the format marker whose bytes changed on disk is found before anything trains on it. Whether
  checksums are checked follows from checksums.json being there, never from a field: a format marker
  flipped to "before checksums" beside a checksums.json is refused, and one of format 3 or later without
  it is refused as damaged.

Nothing in a checkpoint can run code when it is opened. DCP stores every non-tensor value with pickle
and reads it back with torch.load(weights_only=False); so only tensors go through DCP (the optimizer's
per-parameter state, never its param_groups: those come from the resuming run's flags), DCP's index is
written as JSON (`.metadata.json`) instead of a pickle, and the reader refuses an index that names a
non-tensor entry, an unknown dtype or a file outside the checkpoint. Tensors are read with
torch.load(weights_only=True); everything else is JSON or safetensors.

Crash safety: all ranks write into `update_<N>.tmp`; only after every rank reports success does rank 0
write trainer_state.json, then checksums.json (every rank's checksums and trainer_state.json's), and rename
the folder. A folder without `.tmp` that holds trainer_state.json is complete; a save that dies halfway
(killed, disk full) never touches the earlier checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file as load_numpy_file
from safetensors.numpy import save_file as save_numpy_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
from torch.futures import Future
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from sdxl_trainer.distributed.world import all_gather_text
from sdxl_trainer.runtime.files import make_shareable, write_durably, write_error_reason

TRAINER_STATE_FILE = "trainer_state.json"
DATA_POSITION_FILE = "data_position.safetensors"
METADATA_FILE = ".metadata.json"
CHECKSUMS_FILE = "checksums.json"
CHECKPOINT_NAME = re.compile(r"^update_(\d+)$")
ABANDONED_PREFIX = "abandoned_after_"  # + the checkpoint resumed from and the time: a branch set aside by going back
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # the only files DCP's file writer creates
# 1: pickled entries (refused); 2: tensor-only, no checksums (resumed unverified); 3: checksums.json of every file but
# trainer_state.json; 4: checksums.json covers trainer_state.json too. An older trainer refuses format 4 as "newer".
FORMAT_VERSION = 4
RESUMABLE_FORMAT_VERSIONS = (2, 3, 4)
FIRST_CHECKSUMMED_FORMAT = 3
FIRST_CHECKSUMMED_TRAINER_STATE_FORMAT = 4
# SHA-256 through OpenSSL: about 0.8 GB/s per core measured on a plain x86 core, 2 GB/s and more with SHA extensions.
CHECKSUM_ALGORITHM = "sha256"
CHECKSUM_READ_BYTES = 16 << 20
CHECKSUMMED_FILE = re.compile(r"^(__\d+_\d+\.distcp|rng/rank\d+\.safetensors|\.metadata\.json|data_position\.safetensors|trainer_state\.json)$")
DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)}
DISK_FULL_ADVICE = (
    "Free disk space (a checkpoint takes the UNet's fp32 size x 3 with adamw, x 1.5 with adamw8bit, plus x 1 "
    "with --use_ema: about 16 GB for SDXL with adamw8bit), lower --checkpoints_total_limit, or point --output_dir elsewhere."
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what to do."""


# ---- DCP with a JSON index ------------------------------------------------------------------------


def _metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    entries = {}
    for fqn, storage in metadata.state_dict_metadata.items():
        if isinstance(storage, BytesStorageMetadata):
            raise CheckpointError(f"{fqn} is not a tensor and would be pickled: this is a bug, please report it")
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


def _metadata_from_json(data: dict[str, Any], index_file: Path) -> Metadata:
    """DCP's index from our JSON, refusing anything a checkpoint of ours never holds: a non-tensor entry (DCP
    would unpickle it, which can run code), an unknown dtype, a storage transform, a file outside the folder."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{index_file} is refused: {why}. This trainer never writes such a checkpoint: it was altered or made by "
            "something else. Do not resume from it; use another checkpoint (or start from an exported pipeline)."
        )

    entries: dict[str, Any] = {}
    for fqn, entry in data["state_dict_metadata"].items():
        if set(entry) != {"dtype", "requires_grad", "size", "chunks"}:
            raise refuse(f"entry {fqn!r} is not a tensor (reading it would mean unpickling it, which can run code)")
        if entry["dtype"] not in DTYPES:
            raise refuse(f"entry {fqn!r} has the unknown dtype {entry['dtype']!r}")
        properties = TensorProperties(dtype=DTYPES[entry["dtype"]], requires_grad=bool(entry["requires_grad"]))
        chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in entry["chunks"]]
        entries[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
    storage_data = {}
    for item in data["storage_data"]:
        if set(item) != {"fqn", "offset", "index", "path", "start", "length"}:
            raise refuse(f"the storage of {item.get('fqn')!r} has unexpected fields {sorted(set(item) - {'fqn', 'offset', 'index', 'path', 'start', 'length'})}")
        if not SHARD_FILE.match(str(item["path"])):
            raise refuse(f"entry {item['fqn']!r} points at {item['path']!r}, not a shard file of this checkpoint")
        if item["fqn"] not in entries:
            raise refuse(f"the storage names {item['fqn']!r}, which the index does not list")
        index = MetadataIndex(item["fqn"], None if item["offset"] is None else torch.Size(item["offset"]), item["index"])
        storage_data[index] = _StorageInfo(item["path"], int(item["start"]), int(item["length"]))
    meta = data["storage_meta"]
    return Metadata(
        state_dict_metadata=entries,
        planner_data={fqn: tuple(path) for fqn, path in data["planner_data"].items()},
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"], modules=meta["modules"]),
        version=data["version"],
    )


def read_index(checkpoint_dir: Path) -> Metadata:
    index_file = checkpoint_dir / METADATA_FILE
    try:
        data = json.loads(index_file.read_text(encoding="utf-8"))
        return _metadata_from_json(data, index_file)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_file} is damaged ({type(error).__name__}: {error})") from error


class JsonIndexWriter(FileSystemWriter):
    """DCP's file writer, with the checkpoint index written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
        metadata.storage_meta = self.storage_meta()
        write_durably(Path(self.path) / METADATA_FILE, json.dumps(_metadata_to_json(metadata)))


class JsonIndexReader(FileSystemReader):
    """Reads checkpoints written by JsonIndexWriter, through the strict index reader; a record that cannot
    be read is reported with the file that holds it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_index(Path(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:  # noqa: BLE001 - DCP's reading raises whatever torch.load or the file raised
                raise CheckpointError(f"{Path(self.path) / relative_path} could not be read ({type(error).__name__}: {error})") from error
        done: Future[None] = Future()
        done.set_result(None)
        return done


# ---- per-rank RNG states ----------------------------------------------------------------------------


def _rng_name(rank: int) -> str:
    return f"rng/rank{rank}.safetensors"


def _rng_file(checkpoint_dir: Path, rank: int) -> Path:
    return checkpoint_dir / _rng_name(rank)


def _rng_states() -> tuple[dict[str, np.ndarray], str]:
    """This process's torch / CUDA / numpy / Python RNG states, as arrays and a JSON note of the rest."""
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
    return arrays, json.dumps(details)


def _write_rng_states(path: Path, arrays: dict[str, np.ndarray], details: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_numpy_file(arrays, str(path), metadata={"details": details})
    make_shareable(path)


def _restore_rng_states(path: Path) -> None:
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


# ---- what a checkpoint holds besides tensors -----------------------------------------------------------


@dataclass(frozen=True)
class TrainerState:
    """trainer_state.json: the run's counters and the facts a resume checks. Read strictly: an extra or
    mistyped field, or a missing one, is a damaged checkpoint; only a field added after FORMAT_VERSION 2
    (one with a default besides format_version) may be missing: the checkpoint predates it. Formats 2 to 4
    differ only in checksums.json, which format 3 must have, listing this file too from format 4 on."""

    update: int  # optimizer updates done (skipped ones included): the LR schedule's position
    epoch: int  # the epoch to continue (counted from 0)
    updates_in_epoch: int  # its updates already done
    seed: int
    optimizer: str
    use_ema: bool
    ema_updates: int
    world_size: int
    global_batch_size: int
    gradient_accumulation_steps: int
    skipped_updates: int
    consecutive_skipped_updates: int
    loss_scaler: dict[str, float | int] | None  # the fp16 gradient scaler's state
    train_text_encoder: bool = False  # the checkpoint holds trained text encoders (and their optimizer state)
    frozen_text_encoder: str = ""  # the one of them kept frozen by a learning rate of 0 ("text_encoder" / "text_encoder_2"), "" if none
    weights_dtype: str = "fp32"  # of the trained weights (--weights_dtype)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Path) -> TrainerState:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise CheckpointError(f"{source} is damaged (not JSON: {error})") from error
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} is damaged (not a JSON object)")
        if isinstance(data.get("format_version"), int) and data["format_version"] > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} was written by a newer version of this trainer (checkpoint format {data['format_version']}, this one "
                f"reads up to {FORMAT_VERSION}): resume it with that version"
            )
        if data.get("format_version") not in RESUMABLE_FORMAT_VERSIONS:
            raise CheckpointError(
                f"{source} was written by an earlier version of this trainer, whose checkpoints hold pickled entries that "
                "could run code, so it cannot be resumed. Fine-tune on from its exported pipeline instead "
                "(--pretrained_model_name_or_path RUN/pipeline), or finish that run with the earlier version."
            )
        fields = {field.name: field for field in dataclasses.fields(cls)}
        missing = {name for name in set(fields) - set(data) if fields[name].default is dataclasses.MISSING}
        if missing or set(data) - set(fields):
            raise CheckpointError(f"{source} is damaged (fields missing: {sorted(missing)}, unknown: {sorted(set(data) - set(fields))})")
        for name, value in data.items():
            expected = fields[name].type
            if expected == "bool":
                valid = isinstance(value, bool)
            elif expected == "int":
                valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif expected == "str":
                valid = isinstance(value, str)
            else:  # the loss scaler
                valid = value is None or (isinstance(value, dict) and all(isinstance(item, (int, float)) for item in value.values()))
            if not valid:
                raise CheckpointError(f"{source} is damaged ({name} = {value!r} is not a valid {expected})")
        return cls(**data)


def read_trainer_state(checkpoint_dir: Path) -> TrainerState:
    state_file = checkpoint_dir / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint (no {TRAINER_STATE_FILE}): pick another one, or --load_saved_state latest")
    try:
        text = state_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{state_file} cannot be read ({error})") from error
    return TrainerState.from_json(text, state_file)


# ---- checksums ----------------------------------------------------------------------------------------


def file_checksum(path: Path) -> str:
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHECKSUM_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _files_written_by(checkpoint_dir: Path, rank: int) -> list[str]:
    """The files `rank` wrote into a checkpoint, relative to it. DCP's file writer names each rank's shards
    __<rank>_<n>.distcp, and its coordinator, rank 0, writes the index."""
    names = sorted(path.name for path in checkpoint_dir.glob(f"__{rank}_*.distcp"))
    names.append(_rng_name(rank))
    if rank == 0:
        names += [METADATA_FILE, DATA_POSITION_FILE]
    return names


def _write_checksums(checkpoint_dir: Path, checksums: dict[str, str]) -> None:
    """Rank 0, last before the rename: checksums.json, after checking that every other file of the checkpoint
    (trainer_state.json included) has its checksum."""
    unhashed = {path.relative_to(checkpoint_dir).as_posix() for path in checkpoint_dir.rglob("*") if path.is_file()} - set(checksums)
    if unhashed:
        raise CheckpointError(f"no rank hashed {sorted(unhashed)} in {checkpoint_dir}")
    write_durably(checkpoint_dir / CHECKSUMS_FILE, json.dumps({"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(checksums.items()))}, indent=1) + "\n")
    make_shareable(checkpoint_dir / CHECKSUMS_FILE)


def read_checksums(checkpoint_dir: Path) -> dict[str, str] | None:
    """The checksum of every other file (trainer_state.json too from format 4 on), by path inside the folder;
    None where there is no checksums.json (format 2, saved before checksums were recorded: checkpoint_problem
    refuses a later format without it). Its presence, not a field, decides that checksums are checked."""
    path = checkpoint_dir / CHECKSUMS_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        algorithm, files = data["algorithm"], data["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is missing or damaged ({type(error).__name__}: {error})") from error
    if algorithm != CHECKSUM_ALGORITHM or not isinstance(files, dict):
        raise CheckpointError(f"{path} is damaged (algorithm {algorithm!r}, files of type {type(files).__name__})")
    for name, digest in files.items():
        if not CHECKSUMMED_FILE.match(name) or not isinstance(digest, str):
            raise CheckpointError(f"{path} is damaged (it lists {name!r}, not a file of a checkpoint, or no checksum for it)")
    return files


def _checksum_mismatches(checkpoint_dir: Path, checksums: dict[str, str], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        path = checkpoint_dir / name
        try:
            if file_checksum(path) != checksums[name]:
                problems.append(
                    f"{path} does not match its checksum recorded at save: its bytes changed since (a failing disk, an "
                    "interrupted copy or an edit)"
                )
        except OSError as error:
            problems.append(f"{path} cannot be read ({error})")
    return problems


@dataclass(frozen=True)
class Verification:
    """What verify_checkpoint found: the checkpoint's first problem (None: intact), and what it checked."""

    problem: str | None
    checksummed: bool  # False: saved before checksums were recorded, so only the files' presence and sizes were checked
    files: int
    bytes: int
    seconds: float
    trainer_state_checksummed: bool = True  # False: format 3, whose checksums.json leaves trainer_state.json out

    def describe(self, checkpoint_dir: Path) -> str:
        if not self.checksummed:
            return (
                f"{checkpoint_dir} carries no checksums (saved by an earlier version of this trainer): only its files' presence and "
                "sizes are checked, not their content."
            )
        rate = self.bytes / 1e6 / max(self.seconds, 1e-9)
        unchecked = "" if self.trainer_state_checksummed else f" Its {TRAINER_STATE_FILE} carries no checksum (saved by an earlier version of this trainer)."
        return (
            f"Verified the checksums of {checkpoint_dir}'s {self.files} files ({self.bytes / 1e9:.2f} GB) in {self.seconds:.1f} s "
            f"({rate:.0f} MB/s over {dist.get_world_size()} processes).{unchecked}"
        )


def verify_checkpoint(checkpoint_dir: Path) -> Verification:
    """Collective: checkpoint_problem, then the checksum of every file, each rank hashing its share in
    parallel; every rank returns the same result (the problems any rank found)."""
    started = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checksums = None
    problems = []
    problem = checkpoint_problem(checkpoint_dir)
    if problem is not None:
        problems.append(problem)
    else:
        checksums = read_checksums(checkpoint_dir)  # checkpoint_problem read it already, and checked trainer_state.json's
        if checksums is not None:
            shared = sorted(set(checksums) - {TRAINER_STATE_FILE})
            problems += _checksum_mismatches(checkpoint_dir, checksums, shared[rank::world_size])
    found = [text for text in all_gather_text("\n".join(problems), _collective_device()) if text]
    # Every rank finds the same damage outside the checksums (they read the same files): said once.
    agreed = "; ".join(dict.fromkeys(line for text in found for line in text.splitlines())) or None
    size = sum((checkpoint_dir / name).stat().st_size for name in checksums) if checksums and agreed is None else 0
    return Verification(agreed, checksums is not None, len(checksums or ()), size, time.perf_counter() - started, TRAINER_STATE_FILE in (checksums or ()))


# ---- save and load ----------------------------------------------------------------------------------


class Stateful(Protocol):
    """A part of the training state that saves and restores itself (the EMA, the train step's counters)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class HasState(Protocol):
    """A value a checkpoint records (the data position), rebuilt by its owner from what state_dict() gave."""

    def state_dict(self) -> dict: ...


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: Stateful | None) -> dict[str, Any]:
    """What goes through DCP: tensors only. The optimizer's param_groups (learning rate, betas, ...) stay out:
    DCP would pickle them, and a resume takes them from its own flags. The EMA's update count goes into
    trainer_state.json (ema_updates)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    if ema is not None:
        state["ema"] = ema.state_dict()["weights"]
    return state


def _collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _all_ranks_succeeded(succeeded: bool, group: dist.ProcessGroup | None = None) -> bool:
    flag = torch.tensor([1 if succeeded else 0], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class TensorStager:
    """Copies of a state dict's tensors in CPU memory, of the same kinds (a DTensor stays a DTensor of the
    same layout, torchao's 8-bit state keeps its codes, scales and code table: every tensor subclass is copied
    through the tensors it holds), into buffers kept for the next save (pinned on a GPU machine, so the copy
    runs at the bus's speed). A buffer is reused only once the save that read it has ended."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        staged = self._copy(state, ())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies from the GPU were queued without waiting
        return staged

    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key)) for key, item in value.items()}
        if is_traceable_wrapper_subclass(value):
            names, context = value.__tensor_flatten__()
            inner = {name: self._copy(getattr(value, name), (*path, name)) for name in names}
            return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())
        if isinstance(value, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._buffers[path] = buffer
            return buffer.copy_(value.detach(), non_blocking=value.is_cuda)
        return value


@dataclass
class StagedState:
    """A training state as it was at one update, copied off the live tensors (TensorStager): what a save
    writes, also while training goes on."""

    tensors: dict[str, Any]  # through DCP
    rng_arrays: dict[str, np.ndarray]  # this rank's RNG states
    rng_details: str
    position_arrays: dict[str, np.ndarray]  # the data position's arrays (the rest is in trainer_state)
    trainer_state: TrainerState


def stage_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: Stateful | None, trainer_state: TrainerState,
                         position: HasState, stager: TensorStager) -> StagedState:
    """The state to save, copied now (not collective): training may change the live tensors as soon as it returns."""
    rng_arrays, rng_details = _rng_states()
    arrays = {name: np.array(value) for name, value in position.state_dict().items() if isinstance(value, np.ndarray)}
    return StagedState(stager.stage(_tensor_state(model, optimizer, ema)), rng_arrays, rng_details, arrays, trainer_state)


def write_staged_state(
    checkpoint_dir: Path, staged: StagedState, group: dist.ProcessGroup | None = None,
    writer_factory: Callable[[Path], FileSystemWriter] = JsonIndexWriter,
) -> Path:
    """Collective over `group` (every process; a gloo group of its own where this runs beside training):
    writes the staged state into checkpoint_dir. Returns the final folder, or raises CheckpointError on every
    rank (after removing the partial folder) when any rank failed to write; earlier checkpoints are untouched.
    Every rank writes into <name>.tmp; once all succeeded, rank 0 writes trainer_state.json and then
    checksums.json (of every file, trainer_state.json's included), then renames the folder: a folder without
    .tmp is complete, and a save that dies before (killed, disk full) leaves no folder that looks like one."""
    tmp_dir = checkpoint_dir.with_name(checkpoint_dir.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a save that died
    dist.barrier(group=group)
    error: BaseException | None = None
    written: dict[str, str] = {}  # this rank's files and their checksums
    try:
        dcp.save(staged.tensors, storage_writer=writer_factory(tmp_dir), process_group=group)
        _write_rng_states(_rng_file(tmp_dir, rank), staged.rng_arrays, staged.rng_details)
        if rank == 0:
            save_numpy_file(staged.position_arrays, str(tmp_dir / DATA_POSITION_FILE))
            make_shareable(tmp_dir / DATA_POSITION_FILE)
        # Each rank hashes what it wrote, in parallel, while it is still in this machine's page cache.
        written = {name: file_checksum(tmp_dir / name) for name in _files_written_by(tmp_dir, rank)}
    # DCP's CheckpointException is a BaseException: caught by name, so a disk-full save is a warning, not a crash.
    except (Exception, CheckpointException) as caught:  # noqa: BLE001 - every rank must learn of a failure on any rank
        error = caught
    if _all_ranks_succeeded(error is None, group):
        gathered = all_gather_text(json.dumps(written), _collective_device(group), group)
        checksums = {name: digest for text in gathered for name, digest in json.loads(text).items()}
        if rank == 0:
            try:
                write_durably(tmp_dir / TRAINER_STATE_FILE, staged.trainer_state.to_json())
                checksums[TRAINER_STATE_FILE] = file_checksum(tmp_dir / TRAINER_STATE_FILE)
                _write_checksums(tmp_dir, checksums)
                if checkpoint_dir.exists():
                    shutil.rmtree(checkpoint_dir)
                tmp_dir.rename(checkpoint_dir)
            except Exception as caught:  # noqa: BLE001
                error = caught
    if not _all_ranks_succeeded(error is None, group):
        reason = write_error_reason(error, checkpoint_dir.parent)  # before the partial folder frees its space
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        disk_full = error is None or reason == "the disk is full" or isinstance(error, OSError)
        advice = DISK_FULL_ADVICE if disk_full else "This is a bug: please report it with this message."
        raise CheckpointError(
            f"Could not save a checkpoint to {checkpoint_dir} ({reason}). Earlier checkpoints are untouched. {advice}"
        ) from (error if isinstance(error, Exception) else None)
    return checkpoint_dir


def checkpoint_problem(checkpoint_dir: Path) -> str | None:
    """Why the checkpoint cannot be resumed (damaged, incomplete, refused), or None if it looks intact.
    Checks every file it needs without reading the tensors: a truncated shard shows in its size. Whether
    the files' bytes are those saved is verify_checkpoint's question, but for trainer_state.json's (a few
    hundred bytes), checked here before it is read: a flipped bit in a counter or in the format marker is
    found before either is believed."""
    try:
        checksums = read_checksums(checkpoint_dir)
        if checksums is not None and TRAINER_STATE_FILE in checksums:
            mismatches = _checksum_mismatches(checkpoint_dir, checksums, [TRAINER_STATE_FILE])
            if mismatches and (checkpoint_dir / TRAINER_STATE_FILE).is_file():
                return mismatches[0]
        state = read_trainer_state(checkpoint_dir)
        index = read_index(checkpoint_dir)
    except CheckpointError as error:
        return str(error)
    checksums_file, state_file = checkpoint_dir / CHECKSUMS_FILE, checkpoint_dir / TRAINER_STATE_FILE
    if checksums is None and state.format_version >= FIRST_CHECKSUMMED_FORMAT:
        return f"{checksums_file} is missing or damaged (checkpoints of format {state.format_version}, as {state_file} says, always have one)"
    if checksums is not None and state.format_version < FIRST_CHECKSUMMED_FORMAT:
        return (
            f"{state_file} says format {state.format_version} (saved before checksums were recorded), but {checksums_file} is there: "
            "one of them is damaged"
        )
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if checksums is not None:
        required = [*needed, METADATA_FILE, DATA_POSITION_FILE, *map(_rng_name, range(state.world_size))]
        if state.format_version >= FIRST_CHECKSUMMED_TRAINER_STATE_FORMAT:
            required.append(TRAINER_STATE_FILE)
        unlisted = sorted(set(required) - set(checksums))
        if unlisted:
            return f"{checkpoint_dir / CHECKSUMS_FILE} lists no checksum for {', '.join(unlisted)}: it is damaged"
    for name, size in sorted(needed.items()):
        path = checkpoint_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} is truncated ({path.stat().st_size} of at least {size} bytes)"
    wanted = {checkpoint_dir / DATA_POSITION_FILE: {"carried_in", "consumed"}}
    wanted |= {_rng_file(checkpoint_dir, rank): None for rank in range(state.world_size)}
    for path, keys in wanted.items():
        try:
            with safe_open(str(path), framework="numpy") as handle:
                if keys is not None and set(handle.keys()) != keys:
                    return f"{path} is damaged (holds {sorted(handle.keys())}, not {sorted(keys)})"
        except (OSError, SafetensorError) as error:
            return f"{path} is missing or damaged ({error})"
    return None


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
    state = _tensor_state(model, optimizer, ema)
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
    rng_file = _rng_file(checkpoint_dir, dist.get_rank())
    if rng_file.is_file():
        _restore_rng_states(rng_file)
    arrays = load_numpy_file(str(checkpoint_dir / DATA_POSITION_FILE))
    return trainer_state, {"epoch": trainer_state.epoch, "updates_in_epoch": trainer_state.updates_in_epoch, **arrays}


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
