"""Writing a cache: each worker's lock, its shards and manifest parts (committed in that order), the empty
prompt, and setting damaged files aside.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import (
    DAMAGED_DIR,
    EMPTY_PROMPT_FILE,
    FLIPPED_KEY,
    LOCK_DIR,
    LOSS_MASK_KEY,
    MANIFEST_DIR,
    MANIFEST_SCHEMA,
    SHARD_DIR,
    SHARED_FILE_CHECKSUM_KEYS,
    STORAGE_DTYPE,
    TENSOR_KEYS,
    CachedItem,
    CacheLocation,
)
from sdxl_trainer.cache.object_lease import ObjectLease
from sdxl_trainer.cache.stores import open_store
from sdxl_trainer.runtime.files import LockHeld, ProcessLock, make_shareable
from sdxl_trainer.runtime.hashing import sha256_file


def write_empty_prompt(cache_dir: CacheLocation, prompt_embeds: torch.Tensor, pooled_prompt_embeds: torch.Tensor) -> None:
    """Written once: every worker computes the same tensors (same settings), so the first one keeps them."""
    store = open_store(cache_dir)
    store.remove_stale_staging(EMPTY_PROMPT_FILE)
    if store.exists(EMPTY_PROMPT_FILE):
        return
    staged = store.staging_path(EMPTY_PROMPT_FILE)
    try:
        save_file(
            {
                "prompt_embeds": prompt_embeds.to(STORAGE_DTYPE).contiguous(),
                "pooled_prompt_embeds": pooled_prompt_embeds.to(STORAGE_DTYPE).contiguous(),
            },
            staged,
        )
        make_shareable(staged)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    store.publish_once(staged, EMPTY_PROMPT_FILE)


class WorkerLock:
    """One process per worker name and cache: a second one started by mistake would redo all the work and race on
    the same files. In a folder, a ProcessLock (flock) on locks/<worker>.lock; in object storage, which has no
    locks, a lease object there (LEASE_S)."""

    def __init__(self, cache_dir: CacheLocation, worker_name: str):
        store = open_store(cache_dir)
        try:
            self._lock = ObjectLease(store, f"{LOCK_DIR}/{worker_name}.lock") if store.remote else ProcessLock(store.root / LOCK_DIR / f"{worker_name}.lock")
        except LockHeld as held:
            raise CacheError(
                f"{held} is already caching worker {worker_name} into {store}: wait for it to finish, or give this "
                "process another --shard_index / --num_shards"
            ) from None

    def confirm(self) -> None:
        """Call before each commit. In object storage, renew the lease now (no other process can take it over
        for LEASE_S from here), or raise LeaseLost where another process took it over while this one stalled; a
        folder's flock cannot be lost."""
        if isinstance(self._lock, ObjectLease):
            self._lock.confirm()

    def release(self) -> None:
        self._lock.release()


class ShardWriter:
    """Writes one worker's shards and manifest parts. `worker_name` must be unique among writers."""

    def __init__(self, cache_dir: CacheLocation, worker_name: str):
        self.store = open_store(cache_dir)
        self.worker_name = worker_name
        self.store.make_folders(SHARD_DIR, MANIFEST_DIR)
        existing = [int(Path(name).stem.rsplit("-", 1)[1]) for name in self._mine(MANIFEST_DIR, ".parquet")]
        self.next_seq = max(existing, default=-1) + 1
        # The cache script writes both shared files before any shard, and they never change afterwards.
        self.shared_file_checksums = {key: self.store.sha256(name) for name, key in SHARED_FILE_CHECKSUM_KEYS.items() if self.store.exists(name)}
        self._remove_leftovers()

    def _mine(self, folder: str, suffix: str) -> list[str]:
        return [name for name in self.store.names(folder, suffix) if Path(name).name.startswith(f"{self.worker_name}-")]

    def _remove_leftovers(self) -> None:
        """Delete what a killed run of this same worker left unfinished: temporary files and shards without a
        manifest part. Only this worker writes files with its name, so nothing of another worker is touched."""
        committed = {Path(name).stem for name in self._mine(MANIFEST_DIR, ".parquet")}
        for folder in (SHARD_DIR, MANIFEST_DIR):
            self.store.remove_staging_of(folder, self.worker_name)
        for name in self._mine(SHARD_DIR, ".safetensors"):
            if Path(name).stem not in committed:
                self.store.remove(name)

    def write(self, items: list[CachedItem]) -> str:
        """Write `items` as one shard + manifest part; returns the manifest part's name (relative to the cache).

        On any error (a full disk above all) the staged file is removed and the error re-raised: what was
        committed before stays valid, and nothing half-written is left under a final name."""
        name = f"{self.worker_name}-{self.next_seq:06d}"
        shard_name = f"{SHARD_DIR}/{name}.safetensors"
        tensors = {}
        for index, item in enumerate(items):
            for key in TENSOR_KEYS:
                tensors[f"{index}/{key}"] = getattr(item, key).to(STORAGE_DTYPE).contiguous()
            if item.latents_flipped is not None:
                tensors[f"{index}/{FLIPPED_KEY}"] = item.latents_flipped.to(STORAGE_DTYPE).contiguous()
            if item.loss_mask is not None:
                tensors[f"{index}/{LOSS_MASK_KEY}"] = item.loss_mask.to(STORAGE_DTYPE).contiguous()
        staged = self.store.staging_path(shard_name)
        try:
            save_file(tensors, staged)
            make_shareable(staged)
            shard_sha256, shard_bytes = sha256_file(staged), staged.stat().st_size
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.store.publish(staged, shard_name)

        rows = [dict(item.row, shard=Path(shard_name).name, index_in_shard=index) for index, item in enumerate(items)]
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).replace_schema_metadata(
            {
                "shard": Path(shard_name).name,
                "shard_sha256": shard_sha256,
                "shard_bytes": str(shard_bytes),
                "written_at_ns": str(time.time_ns()),
                **self.shared_file_checksums,
            }
        )
        part_name = f"{MANIFEST_DIR}/{name}.parquet"
        staged = self.store.staging_path(part_name)
        try:
            pq.write_table(table, staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.store.publish(staged, part_name)
        self.next_seq += 1
        return part_name


def quarantine(cache_dir: CacheLocation, *names: str) -> None:
    """Move damaged files (a shard and its manifest part, or an unreadable part; names relative to the cache) into
    damaged/, so their rows no longer count and their items get re-encoded. Another worker may have moved them
    already: fine."""
    store = open_store(cache_dir)
    for name in names:
        store.move(name, f"{DAMAGED_DIR}/{Path(name).name}")
