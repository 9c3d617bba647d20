"""Is a checkpoint intact? Its files' presence and sizes (checkpoint_problem), then every file's checksum
(verify_checkpoint, collective).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from sdxl_trainer.distributed.world import all_gather_text, collective_device
from sdxl_trainer.state.checkpoint_layout import (
    CHECKSUMS_FILE,
    DATA_POSITION_FILE,
    FIRST_CHECKSUMMED_FORMAT,
    FIRST_CHECKSUMMED_TRAINER_STATE_FORMAT,
    METADATA_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
)
from sdxl_trainer.state.checksums import checksum_mismatches, read_checksums
from sdxl_trainer.state.dcp_json_index import read_index
from sdxl_trainer.state.rng_states import rng_file, rng_file_name
from sdxl_trainer.state.trainer_state import read_trainer_state


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
            problems += checksum_mismatches(checkpoint_dir, checksums, shared[rank::world_size])
    found = [text for text in all_gather_text("\n".join(problems), collective_device()) if text]
    # Every rank finds the same damage outside the checksums (they read the same files): said once.
    agreed = "; ".join(dict.fromkeys(line for text in found for line in text.splitlines())) or None
    size = sum((checkpoint_dir / name).stat().st_size for name in checksums) if checksums and agreed is None else 0
    return Verification(agreed, checksums is not None, len(checksums or ()), size, time.perf_counter() - started, TRAINER_STATE_FILE in (checksums or ()))


def checkpoint_problem(checkpoint_dir: Path) -> str | None:
    """Why the checkpoint cannot be resumed (damaged, incomplete, refused), or None if it looks intact.
    Checks every file it needs without reading the tensors: a truncated shard shows in its size. Whether
    the files' bytes are those saved is verify_checkpoint's question, but for trainer_state.json's (a few
    hundred bytes), checked here before it is read: a flipped bit in a counter or in the format marker is
    found before either is believed."""
    try:
        checksums = read_checksums(checkpoint_dir)
        if checksums is not None and TRAINER_STATE_FILE in checksums:
            mismatches = checksum_mismatches(checkpoint_dir, checksums, [TRAINER_STATE_FILE])
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
        required = [*needed, METADATA_FILE, DATA_POSITION_FILE, *map(rng_file_name, range(state.world_size))]
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
    wanted |= {rng_file(checkpoint_dir, rank): None for rank in range(state.world_size)}
    for path, keys in wanted.items():
        try:
            with safe_open(str(path), framework="numpy") as handle:
                if keys is not None and set(handle.keys()) != keys:
                    return f"{path} is damaged (holds {sorted(handle.keys())}, not {sorted(keys)})"
        except (OSError, SafetensorError) as error:
            return f"{path} is missing or damaged ({error})"
    return None
