"""checksums.json: the SHA-256 of every other file of a checkpoint, written last at a save and checked at a resume."""

from __future__ import annotations

import json
from pathlib import Path

from sdxl_trainer.runtime.files import make_shareable, write_durably
from sdxl_trainer.runtime.hashing import sha256_file
from sdxl_trainer.state.checkpoint_layout import CHECKSUMMED_FILE, CHECKSUMS_FILE, DATA_POSITION_FILE, METADATA_FILE, CheckpointError
from sdxl_trainer.state.rng_states import rng_file_name

CHECKSUM_ALGORITHM = "sha256"  # recorded in checksums.json; file_checksum computes it
CHECKSUM_READ_BYTES = 16 << 20


def file_checksum(path: Path) -> str:
    return sha256_file(path, CHECKSUM_READ_BYTES)


def files_written_by(checkpoint_dir: Path, rank: int) -> list[str]:
    """The files `rank` wrote into a checkpoint, relative to it. DCP's file writer names each rank's shards
    __<rank>_<n>.distcp, and its coordinator, rank 0, writes the index."""
    names = sorted(path.name for path in checkpoint_dir.glob(f"__{rank}_*.distcp"))
    names.append(rng_file_name(rank))
    if rank == 0:
        names += [METADATA_FILE, DATA_POSITION_FILE]
    return names


def write_checksums(checkpoint_dir: Path, checksums: dict[str, str]) -> None:
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


def checksum_mismatches(checkpoint_dir: Path, checksums: dict[str, str], names: list[str]) -> list[str]:
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
