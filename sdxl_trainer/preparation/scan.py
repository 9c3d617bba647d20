"""What a scan of the data finds: image + caption pairs (in a folder, a metadata table or tar shards), the
problems it names, and which worker caches each pair.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.local_store import LocalStore
from sdxl_trainer.cache.s3_store import RemoteStore


@dataclass(frozen=True)
class SourcePair:
    image_path: Path
    relative_path: str  # image path relative to the data folder, '/'-separated: the item's identity
    caption_path: Path | None = None  # found by the scan (any case of .txt); None = the image's name with .txt
    caption_text: str | None = None  # from a metadata table (metadata.py): used instead of a caption file
    table_size: tuple[int, int] | None = None  # (width, height) upright, as a metadata table states it: --dry_run trusts it
    mask_path: Path | None = None  # the image's loss mask file (name.mask.png), found by the scan
    tar_member: TarMember | None = None  # in a tar shard (tar_sources.py): the image's bytes are read from there, not image_path

    @property
    def expected_caption(self) -> Path:
        return self.caption_path or self.image_path.with_suffix(".txt")


@dataclass(frozen=True)
class ScanProblem:
    """Something under the data folder that looks like data but cannot be used, with why."""

    relative_path: str
    reason: str
    category: str


@dataclass
class DataScan:
    pairs: list[SourcePair]  # sorted by relative path
    problems: list[ScanProblem]


def normalized_caption(text: str) -> str:
    """Whitespace collapsed within each line, empty lines dropped: one caption per line (cache.captions_in)."""
    return "\n".join(line for line in (" ".join(raw.split()) for raw in text.splitlines()) if line)


def worker_of(relative_path: str, num_workers: int) -> int:
    """Which of num_workers caches this item: a stable hash of its path, the same on every machine."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % num_workers


@dataclass(frozen=True)
class TarMember:
    """Where one member's bytes lie in its tar: read directly (one ranged request in object storage), without tarfile."""

    store: LocalStore | RemoteStore  # --data_dir
    tar_name: str  # relative to the store
    name: str
    offset: int  # of the member's data from the start of the tar file, in bytes
    size: int  # bytes

    def read_bytes(self) -> bytes:
        try:
            data = self.store.read_range(self.tar_name, self.offset, self.offset + self.size)
        except StorageError as error:
            raise OSError(str(error)) from error  # an unreadable image: skipped and named, as a local read error is
        if len(data) != self.size:
            raise OSError(f"{Path(self.tar_name).name} ends inside {self.name}: it was cut short since the scan; copy it again")
        return data
