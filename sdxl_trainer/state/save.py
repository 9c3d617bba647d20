"""Saving: the training state copied off the live tensors (staging), then written by every rank through DCP
into `update_<N>.tmp`, checksummed and renamed into place only once every rank succeeded.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.numpy import save_file as save_numpy_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from sdxl_trainer.distributed.world import all_gather_text, all_ranks_succeeded, collective_device
from sdxl_trainer.runtime.files import make_shareable, write_durably, write_error_reason
from sdxl_trainer.state.checkpoint_layout import DATA_POSITION_FILE, TRAINER_STATE_FILE, CheckpointError
from sdxl_trainer.state.checksums import file_checksum, files_written_by, write_checksums
from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.rng_states import current_rng_states, rng_file, write_rng_states
from sdxl_trainer.state.trainer_state import TrainerState

DISK_FULL_ADVICE = (
    "Free disk space (a checkpoint takes the UNet's fp32 size x 3 with adamw or adamw_schedulefree, x 5 with prodigy, x 1.5 with adamw8bit, plus x 1 "
    "with --use_ema: about 16 GB for SDXL with adamw8bit), lower --checkpoints_total_limit, or point --output_dir elsewhere."
)


class Stateful(Protocol):
    """A part of the training state that saves and restores itself (the EMA, the train step's counters)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class HasState(Protocol):
    """A value a checkpoint records (the data position), rebuilt by its owner from what state_dict() gave."""

    def state_dict(self) -> dict: ...


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: Stateful | None) -> dict[str, Any]:
    """What goes through DCP: tensors only. The optimizer's param_groups (learning rate, betas, ...) stay out:
    DCP would pickle them, and a resume takes them from its own flags. The EMA's update count goes into
    trainer_state.json (ema_updates)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    if ema is not None:
        state["ema"] = ema.state_dict()["weights"]
    return state


class SharedBuffer:
    """Bytes in an anonymous memory file (memfd), mapped here, and by another process of this user through
    `path` (the background save's writer process, writer_process.py): nothing on disk, and not bounded by
    /dev/shm's size. Its tensors (tensor_at) each own their stretch of it, rather than viewing one big tensor, so
    that DCP writes each one's values alone. On a GPU machine the training process registers it as pinned
    memory, so copies from the GPU run at the bus's speed."""

    _made = 0

    def __init__(self, size: int, path: str | None = None):
        """A new buffer of `size` bytes, or (`path`) the one another process made, mapped here."""
        self.size = size
        if path is None:
            SharedBuffer._made += 1
            self.id = SharedBuffer._made  # a new buffer may reuse a closed one's descriptor, so its path
            fd = os.memfd_create("sdxl_trainer_staged_state")
            os.ftruncate(fd, max(size, 1))
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            self.id, self.path, fd = 0, path, os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, max(size, 1))
        self._address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        pinned = path is None and torch.cuda.is_available() and _cuda_host_register(self._address, max(size, 1))
        # The descriptor stays open for the writer to map the file by its path, and is closed with the buffer.
        self._release = weakref.finalize(self, _release, fd, self._address if pinned else None)

    def tensor_at(self, offset: int | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the buffer's bytes from `offset` (None: an empty tensor)."""
        if offset is None:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=shape.numel(), offset=offset).view(shape)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where `tensor` (one of tensor_at's) starts in the buffer, in bytes; None for an empty one."""
        if tensor.numel() == 0:
            return None
        offset = tensor.data_ptr() - self._address
        if not (0 <= offset and offset + tensor.numel() * tensor.element_size() <= self.size and tensor.is_contiguous()):
            raise ValueError("not a tensor of this buffer")
        return offset

    def close(self) -> None:
        """Unpins and closes the file; the memory is freed once no tensor and no other process maps it."""
        self._release()


def _release(fd: int, pinned_address: int | None) -> None:
    if pinned_address is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_address)
    os.close(fd)


def _cuda_host_register(address: int, size: int) -> bool:
    """Pins memory (cudaHostRegister, as DCP's process-based save pins its shared memory); False where the
    driver refuses, and copies then run unpinned, slower."""
    return int(torch.cuda.cudart().cudaHostRegister(address, size, 1)) == 0  # 1: cudaHostRegisterPortable


ALIGNMENT = 64  # bytes: where each staged tensor starts in the shared buffer


class TensorStager:
    """Copies of a state dict's tensors in CPU memory, of the same kinds (a DTensor stays a DTensor of the
    same layout, torchao's 8-bit state keeps its codes, scales and code table: every tensor subclass is copied
    through the tensors it holds), laid out in one SharedBuffer that the background save's writer process
    reads. The buffer is kept for the next save while the state has the same tensors; it is reused only once
    the save that read it has ended."""

    def __init__(self) -> None:
        self.buffer: SharedBuffer | None = None
        self._views: list[torch.Tensor] = []  # one per plain tensor of the state, in the buffer

    def stage(self, state: Any) -> Any:
        leaves: list[torch.Tensor] = []
        _collect_tensors(state, leaves)
        shapes = [(leaf.shape, leaf.dtype) for leaf in leaves]
        if self.buffer is None or shapes != [(view.shape, view.dtype) for view in self._views]:
            self._new_buffer(shapes)
        views = iter(self._views)
        staged = _copied(state, views)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies from the GPU were queued without waiting
        return staged

    def _new_buffer(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> None:
        offsets, end = [], 0
        for shape, dtype in shapes:
            offsets.append(end)
            end += -(-shape.numel() * dtype.itemsize // ALIGNMENT) * ALIGNMENT
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = SharedBuffer(end)
        self._views = [self.buffer.tensor_at(offset if shape.numel() else None, shape, dtype) for offset, (shape, dtype) in zip(offsets, shapes)]


def _collect_tensors(value: Any, leaves: list[torch.Tensor]) -> None:
    """The plain tensors of a state dict, in the order _copied visits them."""
    if isinstance(value, dict):
        for item in value.values():
            _collect_tensors(item, leaves)
    elif is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            _collect_tensors(getattr(value, name), leaves)
    elif isinstance(value, torch.Tensor):
        leaves.append(value)


def _copied(value: Any, views) -> Any:
    """`value` with each plain tensor copied into the next of `views` (same shape and dtype)."""
    if isinstance(value, dict):
        return {key: _copied(item, views) for key, item in value.items()}
    if is_traceable_wrapper_subclass(value):
        names, context = value.__tensor_flatten__()
        inner = {name: _copied(getattr(value, name), views) for name in names}
        return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())
    if isinstance(value, torch.Tensor):
        return next(views).copy_(value.detach(), non_blocking=value.is_cuda)
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
    rng_arrays, rng_details = current_rng_states()
    arrays = {name: np.array(value) for name, value in position.state_dict().items() if isinstance(value, np.ndarray)}
    return StagedState(stager.stage(tensor_state(model, optimizer, ema)), rng_arrays, rng_details, arrays, trainer_state)


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
        write_rng_states(rng_file(tmp_dir, rank), staged.rng_arrays, staged.rng_details)
        if rank == 0:
            save_numpy_file(staged.position_arrays, str(tmp_dir / DATA_POSITION_FILE))
            make_shareable(tmp_dir / DATA_POSITION_FILE)
        # Each rank hashes what it wrote, in parallel, while it is still in this machine's page cache.
        written = {name: file_checksum(tmp_dir / name) for name in files_written_by(tmp_dir, rank)}
    # DCP's CheckpointException is a BaseException: caught by name, so a disk-full save is a warning, not a crash.
    except (Exception, CheckpointException) as caught:  # noqa: BLE001 - every rank must learn of a failure on any rank
        error = caught
    if all_ranks_succeeded(error is None, group):
        gathered = all_gather_text(json.dumps(written), collective_device(group), group)
        checksums = {name: digest for text in gathered for name, digest in json.loads(text).items()}
        if rank == 0:
            try:
                write_durably(tmp_dir / TRAINER_STATE_FILE, staged.trainer_state.to_json())
                checksums[TRAINER_STATE_FILE] = file_checksum(tmp_dir / TRAINER_STATE_FILE)
                write_checksums(tmp_dir, checksums)
                if checkpoint_dir.exists():
                    shutil.rmtree(checkpoint_dir)
                tmp_dir.rename(checkpoint_dir)
            except Exception as caught:  # noqa: BLE001
                error = caught
    if not all_ranks_succeeded(error is None, group):
        reason = write_error_reason(error, checkpoint_dir.parent)  # before the partial folder frees its space
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        disk_full = error is None or reason == "the disk is full" or isinstance(error, OSError)
        advice = DISK_FULL_ADVICE if disk_full else "This is a bug: please report it with this message."
        raise CheckpointError(
            f"Could not save a checkpoint to {checkpoint_dir} ({reason}). Earlier checkpoints are untouched. {advice}"
        ) from (error if isinstance(error, Exception) else None)
    return checkpoint_dir
