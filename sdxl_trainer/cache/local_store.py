"""A cache in a local folder: files written under a temporary name, fsynced and renamed; shards memory-mapped."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO, Iterable

import torch
from safetensors import safe_open

from sdxl_trainer.runtime.hashing import sha256_file

STALE_TMP_S = 60.0  # a temporary file older than this was left by a killed worker


class LocalTensors:
    """A local shard, memory-mapped by safetensors."""

    def __init__(self, path: Path):
        self._handle = safe_open(str(path), framework="pt")
        self._keys = set(self._handle.keys())  # keys() builds a new list per call

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(self._handle.get_slice(key).get_shape()) for key in self._keys}

    def has(self, key: str) -> bool:
        return key in self._keys

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self._handle.get_tensor(key) for key in keys}


class LocalStore:
    remote = False

    def __init__(self, root: Path):
        self.root = root

    def __str__(self) -> str:
        return str(self.root)

    def location(self, name: str) -> str:
        """How a user finds the file `name` (in messages)."""
        return str(self.root / name)

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def is_folder(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def size(self, name: str) -> int | None:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    def entries(self, folder: str) -> list[str]:
        """Sorted names of what `folder` holds directly (files and folders, hidden ones too); [] if it is no folder."""
        path = self.root / folder
        return sorted(child.name for child in path.iterdir()) if path.is_dir() else []

    def names(self, folder: str, suffix: str) -> list[str]:
        """Sorted names (relative to the root) of the files in `folder` ending in `suffix`; temporary files excluded."""
        return sorted(f"{folder}/{path.name}" for path in (self.root / folder).glob(f"[!.]*{suffix}"))

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes start..end of `name` (fewer where the file is shorter)."""
        with open(self.root / name, "rb") as handle:
            handle.seek(start)
            return handle.read(end - start)

    def open_binary(self, name: str) -> BinaryIO:
        return open(self.root / name, "rb")

    def find(self, suffix: str) -> list[str]:
        """Sorted names of every file under the root (recursively) ending in `suffix`, hidden names skipped."""
        return sorted(
            path.relative_to(self.root).as_posix() for path in self.root.rglob(f"*{suffix}")
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(self.root).parts)
        )

    def sha256(self, name: str) -> str:
        return sha256_file(self.root / name)

    def make_folders(self, *names: str) -> None:
        for name in names:
            (self.root / name).mkdir(parents=True, exist_ok=True)

    def staging_path(self, name: str) -> Path:
        """Where to write `name` before publish(): beside it, so the rename stays on one file system."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def publish(self, staged: Path, name: str) -> None:
        """fsync then rename, so a crash leaves either the old file, the new one, or a stray .tmp: never half."""
        try:
            with open(staged, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(staged, self.root / name)
        finally:
            staged.unlink(missing_ok=True)

    def publish_once(self, staged: Path, name: str) -> bool:
        """Publish unless `name` exists (atomic, also on NFS: a hard link fails if the name is taken). Returns
        whether this call created it; the staged file is removed either way."""
        try:
            with open(staged, "rb+") as handle:
                os.fsync(handle.fileno())
            os.link(staged, self.root / name)
            return True
        except FileExistsError:
            return False
        finally:
            staged.unlink(missing_ok=True)

    def remove_stale_staging(self, name: str) -> None:
        """Temporary files of `name` left by a killed writer (a live one renames its own within a second)."""
        path = self.root / name
        for staged in path.parent.glob(f".{path.name}.*.tmp"):
            try:
                if time.time() - staged.stat().st_mtime > STALE_TMP_S:
                    staged.unlink()
            except FileNotFoundError:
                pass

    def remove_staging_of(self, folder: str, owner: str) -> None:
        """Every temporary file in `folder` of files named `owner`-*: that writer's own, left by its killed run."""
        for staged in (self.root / folder).glob(f".{owner}-*.tmp"):
            staged.unlink(missing_ok=True)

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def move(self, name: str, new_name: str) -> None:
        """Rename; a file another worker moved already is fine."""
        (self.root / new_name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(self.root / name, self.root / new_name)
        except FileNotFoundError:
            pass

    def open_tensors(self, name: str) -> LocalTensors:
        return LocalTensors(self.root / name)

    def read_items(self, requests: list[tuple[LocalTensors, list[str]]]) -> list[dict[str, torch.Tensor]]:
        return [tensors.read(keys) for tensors, keys in requests]
