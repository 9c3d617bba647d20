"""Reading a cache: the manifest merged from every worker's parts, the intact ones only, and the tensors of
items from their shards (local files or object storage).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load

from sdxl_trainer.cache.errors import CacheError, StorageError
from sdxl_trainer.cache.format import (
    CACHE_INFO_FILE,
    EMPTY_PROMPT_FILE,
    MANIFEST_DIR,
    MANIFEST_SCHEMA,
    SHARD_DIR,
    SHARED_FILE_CHECKSUM_KEYS,
    TENSOR_KEYS,
    VERIFY_COMMAND,
    CacheLocation,
    ManifestPart,
    Store,
    repair_advice,
    sha256_bytes,
)
from sdxl_trainer.cache.local_store import LocalTensors
from sdxl_trainer.cache.s3_store import REMOTE_READ_THREADS, RemoteTensors
from sdxl_trainer.cache.stores import open_store


def size_problem(size: int | None, recorded: int) -> str | None:
    """A shard's size (None: missing) against the one its manifest part records."""
    if size is None:
        return "missing"
    return f"size {size} bytes, manifest says {recorded}" if size != recorded else None


def first_recorded_checksums(store: Store, name: str) -> dict[str, str]:
    """The SHA-256 of the shared file `name` (SHARED_FILE_CHECKSUM_KEYS) as each worker's first manifest part
    recorded it, by part name (empty for a cache without items or written before checksums were kept).

    A part records the file as its worker found it then, so a file damaged and then cached on would be
    recorded damaged by the later parts; each worker's first part predates that. Reading one part per worker
    (its footer's metadata) instead of all keeps this cheap for a cache of millions of items."""
    first_parts: dict[str, str] = {}
    for part_name in store.names(MANIFEST_DIR, ".parquet"):  # sorted: each worker's parts in the order it wrote them
        first_parts.setdefault(part_name.rsplit("-", 1)[0], part_name)

    def recorded(part_name: str) -> str | None:
        try:
            metadata = pq.read_schema(pa.BufferReader(store.read_bytes(part_name))).metadata or {}
        except (OSError, pa.ArrowException):  # a damaged part: the manifest's reader names it (intact_parts)
            return None
        digest = metadata.get(SHARED_FILE_CHECKSUM_KEYS[name].encode())
        return digest.decode() if digest else None

    with ThreadPoolExecutor(REMOTE_READ_THREADS if store.remote else 1) as pool:
        found = dict(zip(first_parts.values(), pool.map(recorded, first_parts.values())))
    return {part_name: digest for part_name, digest in found.items() if digest is not None}


def empty_prompt_problem(data: bytes, recorded: dict[str, str], text_max_length: int | None) -> str | None:
    """What is wrong with the bytes of empty_prompt.safetensors: another SHA-256 than a manifest part recorded
    (part name -> digest), unreadable, other tensors, or (given) another caption length than the cache's."""
    actual = sha256_bytes(data)
    differing = [part_name for part_name, digest in recorded.items() if digest != actual]
    if differing:
        return f"checksum mismatch: its contents changed since {differing[0]} recorded it"
    try:
        tensors = load(data)
    except Exception as error:  # safetensors raises its own error types for bad headers
        return f"unreadable ({error})"
    if set(tensors) != {"prompt_embeds", "pooled_prompt_embeds"}:
        return f"holds the tensors {sorted(tensors)}, not prompt_embeds and pooled_prompt_embeds"
    length = tensors["prompt_embeds"].shape[0]
    if text_max_length is not None and length != text_max_length:
        return f"prompt_embeds are {length} tokens long, but {CACHE_INFO_FILE} says {text_max_length}"
    return None


def read_empty_prompt(cache_dir: CacheLocation, text_max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty caption's embeddings (caption dropout's), checked against the SHA-256 the manifest parts
    recorded (first_recorded_checksums) and, given the cache's text_max_length, their length. A missing or
    damaged file is a CacheError naming it, the repair and --verify."""
    store = open_store(cache_dir)
    try:
        data = store.read_bytes(EMPTY_PROMPT_FILE)
    except FileNotFoundError:
        raise CacheError(f"{store.location(EMPTY_PROMPT_FILE)} not found: the cache is incomplete; re-run sdxl_process_data_dir.py.") from None
    problem = empty_prompt_problem(data, first_recorded_checksums(store, EMPTY_PROMPT_FILE), text_max_length)
    if problem:
        raise CacheError(
            f"{store.location(EMPTY_PROMPT_FILE)} is damaged ({problem}): delete it and re-run the cache command (sdxl_process_data_dir.sh "
            f"with the same flags), which writes it again; `{VERIFY_COMMAND.format(cache_dir=store)}` checks the rest of the cache."
        )
    tensors = load(data)
    return tensors["prompt_embeds"], tensors["pooled_prompt_embeds"]


def _read_part(store: Store, name: str) -> tuple[ManifestPart, pa.Table]:
    handle = pq.ParquetFile(pa.BufferReader(store.read_bytes(name)))
    metadata = handle.schema_arrow.metadata or {}
    table = handle.read(use_threads=False)  # parts are small: the parallelism is across parts
    if not table.schema.equals(MANIFEST_SCHEMA):
        for column in ("crop_left_flipped", "has_loss_mask", "mask_sha256"):  # a part from before flipped latents or masks
            if column not in table.column_names:
                table = table.append_column(column, pa.nulls(len(table), MANIFEST_SCHEMA.field(column).type))
        table = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    part = ManifestPart(
        name=name,
        shard=metadata[b"shard"].decode(),
        shard_sha256=metadata[b"shard_sha256"].decode(),
        shard_bytes=int(metadata[b"shard_bytes"]),
        written_at_ns=int(metadata[b"written_at_ns"]),
        num_rows=len(table),
        shared_file_sha256={file: metadata[key.encode()].decode() for file, key in SHARED_FILE_CHECKSUM_KEYS.items() if key.encode() in metadata},
    )
    return part, table


def read_manifest_part(cache_dir: CacheLocation, name: str) -> pa.Table:
    """One manifest part (`name` relative to the cache), read again after the load: a part that is gone or
    damaged since is a CacheError naming it."""
    store = open_store(cache_dir)
    try:
        return _read_part(store, name)[1]
    except StorageError:
        raise
    except FileNotFoundError:
        raise CacheError(f"manifest part {store.location(name)} is gone since the cache was opened. {repair_advice(store)}") from None
    except (OSError, KeyError, ValueError, pa.ArrowException) as error:
        raise CacheError(f"{store.location(name)}: unreadable manifest part ({type(error).__name__}: {error}). {repair_advice(store)}") from error


def read_manifest_parts(
    cache_dir: CacheLocation, compact: Callable[[pa.Table], pa.Table] | None = None
) -> tuple[list[tuple[ManifestPart, pa.Table]], dict[str, str]]:
    """Every manifest part in write order, and the unreadable ones (name relative to the cache -> reason). With
    `compact`, each part's table is what compact makes of it as it is read (decoded whole first, so damage
    anywhere in it is found), so that only that is ever held for all parts at once.

    Parts are read in parallel threads (Parquet decoding releases the GIL, and object storage answers many
    requests at once): a million items in a few thousand parts load in seconds."""
    store = open_store(cache_dir)
    part_names = store.names(MANIFEST_DIR, ".parquet")
    parts, damaged = [], {}

    def read(name: str):
        try:
            part, table = _read_part(store, name)
            return part, table if compact is None else compact(table)
        except StorageError:
            raise  # the storage, not the part: no reason to call it damaged
        except (OSError, KeyError, ValueError, pa.ArrowException) as error:
            return f"unreadable manifest part ({type(error).__name__}: {error})"

    with ThreadPoolExecutor(REMOTE_READ_THREADS if store.remote else min(8, os.cpu_count() or 1)) as pool:
        for name, result in zip(part_names, pool.map(read, part_names)):
            if isinstance(result, str):
                damaged[name] = result
            else:
                parts.append(result)
    parts.sort(key=lambda item: (item[0].written_at_ns, item[0].name))
    return parts, damaged


def merge_parts(parts: list[tuple[ManifestPart, pa.Table]]) -> pa.Table:
    """Concatenate parts (in write order) keeping, for every image_path, only its last row. The parts' tables
    become the chunks of the result, not copied (unless rows are dropped)."""
    if not parts:
        return MANIFEST_SCHEMA.empty_table()
    merged = pa.concat_tables([table for _, table in parts])
    if len(merged) == 0:
        return merged
    # Last occurrence per image_path, computed in Arrow (a Python dict over millions of rows is slow).
    order = pa.array(np.arange(len(merged), dtype=np.int64))
    last = merged.select(["image_path"]).append_column("row", order).group_by("image_path").aggregate([("row", "max")])
    keep = np.sort(last.column("row_max").to_numpy())
    if len(keep) == len(merged):
        return merged
    return merged.take(pa.array(keep))


def intact_parts(cache_dir: CacheLocation, compact: Callable[[pa.Table], pa.Table] | None = None) -> list[tuple[ManifestPart, pa.Table]]:
    """Every manifest part (each table compacted, see read_manifest_parts); a damaged one is a CacheError."""
    parts, damaged = read_manifest_parts(cache_dir, compact)
    if damaged:
        name, reason = next(iter(damaged.items()))
        store = open_store(cache_dir)
        raise CacheError(f"{store.location(name)}: {reason}. {repair_advice(store)}")
    return parts


def load_manifest(cache_dir: CacheLocation) -> pa.Table:
    """All manifest parts merged into one table. When an image was cached more than once (edited and
    re-cached), the row from the most recently written part wins. A damaged part is a CacheError."""
    return merge_parts(intact_parts(cache_dir))


class CacheReader:
    """Reads items' tensors from shards, keeping a few shards open (a folder's memory-mapped by safetensors, an
    object's header in memory).

    A shard whose size differs from the one its manifest part records (truncated, replaced, missing) is
    refused with a CacheError naming the file; run --verify for the full checksum check. `shard_bytes`
    (shard file name -> size, from the manifest) saves reading the manifest again; without it, it is read
    on first use."""

    def __init__(self, cache_dir: CacheLocation, max_open_shards: int = 16, shard_bytes: dict[str, int] | None = None):
        self.store = open_store(cache_dir)
        self.max_open_shards = max_open_shards
        self._open_shards: OrderedDict[str, LocalTensors | RemoteTensors] = OrderedDict()
        self._shard_bytes = shard_bytes

    def _recorded_bytes(self, shard_name: str) -> int | None:
        if self._shard_bytes is None:  # read lazily: each DataLoader worker process reads its own copy
            self._shard_bytes = {part.shard: part.shard_bytes for part, _ in read_manifest_parts(self.store)[0]}
        return self._shard_bytes.get(shard_name)

    def _shard(self, shard_name: str) -> LocalTensors | RemoteTensors:
        handle = self._open_shards.get(shard_name)
        if handle is None:
            name = f"{SHARD_DIR}/{shard_name}"
            recorded = self._recorded_bytes(shard_name)
            problem = None
            if recorded is None:
                problem = "not listed in any manifest part"
            elif not self.store.remote:  # an object's size is checked against its header below, saving a request
                problem = size_problem(self.store.size(name), recorded)
            if problem is None:
                try:
                    handle = self.store.open_tensors(name)
                except FileNotFoundError:
                    problem = "missing"
                except StorageError:
                    raise
                except Exception as error:  # safetensors raises its own error types for bad headers
                    problem = f"unreadable ({error})"
            if problem is None and self.store.remote and handle.total_bytes != recorded:
                problem = f"size {handle.total_bytes} bytes by its header, manifest says {recorded}"
            if problem is not None:
                raise CacheError(f"cache shard {self.store.location(name)} is damaged: {problem}. {repair_advice(self.store)}")
            self._open_shards[shard_name] = handle
            if len(self._open_shards) > self.max_open_shards:
                self._open_shards.popitem(last=False)
        else:
            self._open_shards.move_to_end(shard_name)
        return handle

    def read(self, shard_name: str, index_in_shard: int, keys: tuple[str, ...] = TENSOR_KEYS) -> dict[str, torch.Tensor]:
        return self.read_many([(shard_name, index_in_shard, keys)])[0]

    def read_many(self, requests: list[tuple[str, int, tuple[str, ...]]]) -> list[dict[str, torch.Tensor]]:
        """Several items' tensors ((shard name, index in shard, keys) each): from object storage, concurrently."""
        opened = []
        for shard_name, index, keys in requests:
            shard = self._shard(shard_name)
            names = [f"{index}/{key}" for key in keys]
            missing = [key for key, name in zip(keys, names) if not shard.has(name)]
            if missing:
                self._unreadable(shard_name, index, f"tensors {missing} missing")
            opened.append((shard, names))
        try:
            found = self.store.read_items(opened)
        except StorageError:
            raise
        except Exception as error:  # safetensors raises its own error types
            shard_name, index, _ = requests[0]
            self._unreadable(shard_name, index if len(requests) == 1 else f"{index} (or another of {len(requests)} read together)", error, error)
        return [{name.split("/", 1)[1]: tensor for name, tensor in tensors.items()} for tensors in found]

    def _unreadable(self, shard_name: str, index: int | str, reason: object, cause: BaseException | None = None):
        raise CacheError(
            f"item {index} of cache shard {self.store.location(f'{SHARD_DIR}/{shard_name}')} is unreadable ({reason}). {repair_advice(self.store)}"
        ) from cause
