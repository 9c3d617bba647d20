"""SHA-256 of a file or a stream, read in chunks (the caches' content hashes, the checkpoints' checksums)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO


def sha256_stream(handle: BinaryIO, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(chunk_bytes):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    with open(path, "rb") as handle:
        return sha256_stream(handle, chunk_bytes)
