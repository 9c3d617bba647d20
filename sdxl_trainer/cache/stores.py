"""Where a cache lives: a local folder (local_store.py), or a prefix in S3-compatible object storage
(`s3://bucket/prefix`, s3_store.py); open_store picks the store of a location.

Both stores offer the few operations the cache needs, on names relative to the cache's root
('shards/w0000of0001-000000.safetensors'). Writes are crash-safe in both: a local file is written under a
temporary name, fsynced and renamed; an object PUT is all-or-nothing, so object storage (which has no rename)
needs no temporary name. The cache's own commit record, a manifest part written after its shard, does the rest.
Every request to object storage has a connect and a read timeout and a bounded number of tries
(s3_requests.py), so a dropped connection is retried and a stalled endpoint fails within minutes; what still
fails is a StorageError naming the object (and the endpoint, for a timeout).
"""

from __future__ import annotations

import re
from pathlib import Path

from sdxl_trainer.cache.local_store import LocalStore
from sdxl_trainer.cache.s3_store import REMOTE_PREFIX, RemoteStore


def is_remote(location: str | Path) -> bool:
    return str(location).startswith(REMOTE_PREFIX)


def cache_identity(location: str | Path) -> str:
    """One name per cache however it is written: a local folder's real path (symlinks resolved, no trailing /), an
    s3:// URL without repeated or trailing slashes."""
    if is_remote(location):
        return REMOTE_PREFIX + re.sub("/+", "/", str(location)[len(REMOTE_PREFIX):]).strip("/")
    return str(Path(location).expanduser().resolve())


def open_store(location: str | Path | LocalStore | RemoteStore) -> LocalStore | RemoteStore:
    """The store of a cache location: an s3:// URL or a local folder (a store is returned as it is)."""
    if isinstance(location, (LocalStore, RemoteStore)):
        return location
    return RemoteStore(str(location)) if is_remote(location) else LocalStore(Path(location))
