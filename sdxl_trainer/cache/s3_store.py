"""A cache under an s3:// prefix. An object PUT is all-or-nothing, so no temporary names; a shard is read with
ranged requests: its safetensors header once, then one request per item covering that item's tensors (a batch's
items concurrently). Every request goes through s3_requests' bounded file system.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

import torch

from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.s3_requests import bounded_s3_file_system, condition_failed, storage_error_reason
from sdxl_trainer.runtime.hashing import sha256_stream
from sdxl_trainer.runtime.tensor_files import header_length, parse_header

REMOTE_PREFIX = "s3://"
REMOTE_READ_THREADS = 32  # manifest parts read at once from object storage (each one request)
HEADER_PROBE_BYTES = 1 << 18  # the first request for a shard's header reads this much (a 256-item shard's is ~100 KB)
REMOTE_BLOCK_BYTES = 8 << 20  # read-ahead of an object opened as a file: a tar's headers a few images apart cost one request
Result = TypeVar("Result")


class RemoteTensors:
    """A shard in object storage: its safetensors header, read once and checked as safetensors checks a file's
    (runtime/tensor_files.py; a damaged one raises DamagedHeader), says where each tensor lies."""

    def __init__(self, store: RemoteStore, name: str):
        self.store, self.name = store, name
        probe = store.read_range(name, 0, HEADER_PROBE_BYTES)
        header_bytes = header_length(probe)
        header = probe[8 : 8 + header_bytes]
        if len(header) < header_bytes:
            header += store.read_range(name, 8 + len(header), 8 + header_bytes)
        self.data_start = 8 + header_bytes
        # A probe shorter than asked for is the whole object: its length is checked too. A longer object's is
        # checked against the manifest (CacheReader) and by each read's length (RemoteStore.read_items).
        whole_object = len(probe) < HEADER_PROBE_BYTES
        self.entries, _ = parse_header(header, len(probe) - self.data_start if whole_object else None)
        self.total_bytes = self.data_start + max((entry.end for entry in self.entries.values()), default=0)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: entry.shape for key, entry in self.entries.items()}

    def has(self, key: str) -> bool:
        return key in self.entries

    def span(self, keys: list[str]) -> tuple[int, int]:
        """The byte range (in the object) covering `keys`: one ranged request reads them all."""
        chosen = [self.entries[key] for key in keys]
        return self.data_start + min(entry.start for entry in chosen), self.data_start + max(entry.end for entry in chosen)

    def decode(self, keys: list[str], data: bytes, first_byte: int) -> dict[str, torch.Tensor]:
        buffer = bytearray(data)  # writable, so the tensors own memory torch may write into
        tensors = {}
        for key in keys:
            dtype, shape, start, end = self.entries[key]
            offset = self.data_start + start - first_byte
            tensors[key] = torch.frombuffer(buffer, dtype=dtype, count=(end - start) // dtype.itemsize, offset=offset).reshape(shape) \
                if end > start else torch.empty(shape, dtype=dtype)
        return tensors


class RemoteStore:
    """A cache under an s3:// prefix. The s3fs file system is made per process (DataLoader workers fork)."""

    remote = True

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._root = self.url[len(REMOTE_PREFIX) :]
        self._fs = None
        self._fs_pid = None

    def __str__(self) -> str:
        return self.url

    def __getstate__(self):  # the file system holds an event loop and connections: each process makes its own
        return {"url": self.url, "_root": self._root, "_fs": None, "_fs_pid": None}

    @property
    def fs(self):
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = bounded_s3_file_system()
            self._fs_pid = os.getpid()
        return self._fs

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key(self, name: str) -> str:
        return f"{self._root}/{name}" if name else self._root

    def _call(self, what: str, name: str, action: Callable[[], Result]) -> Result:
        """Run one request; turn what the network or the service answered into a StorageError naming the object
        (a missing object stays FileNotFoundError, for the caller to word)."""
        try:
            return action()
        except (FileNotFoundError, StorageError):
            raise
        except Exception as error:  # botocore, aiohttp and s3fs raise many types for the same few causes
            raise StorageError(f"{what} {self.location(name)} failed: {storage_error_reason(error)}") from error

    def exists(self, name: str) -> bool:
        return self._call("checking", name, lambda: self.fs.exists(self._key(name)))

    def is_folder(self, name: str) -> bool:
        return bool(self._call("listing", name, lambda: self._list(name)))

    def size(self, name: str) -> int | None:
        try:
            return self._call("reading the size of", name, lambda: self.fs.info(self._key(name))["size"])
        except FileNotFoundError:
            return None

    def _list(self, folder: str) -> list[str]:
        try:
            return self.fs.ls(self._key(folder), detail=False)
        except FileNotFoundError:
            return []

    def entries(self, folder: str) -> list[str]:
        """Sorted names of what `folder` holds directly (objects and prefixes below it), as a folder's entries."""
        return sorted(key.rstrip("/").rsplit("/", 1)[-1] for key in self._call("listing", folder, lambda: self._list(folder)))

    def names(self, folder: str, suffix: str) -> list[str]:
        found = self._call("listing", folder, lambda: self._list(folder))
        return sorted(f"{folder}/{key.rsplit('/', 1)[1]}" for key in found if key.endswith(suffix) and not key.rsplit("/", 1)[1].startswith("."))

    def read_bytes(self, name: str) -> bytes:
        return self._call("reading", name, lambda: self.fs.cat_file(self._key(name)))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self._call("reading", name, lambda: self.fs.cat_file(self._key(name), start=start, end=end))

    def open_binary(self, name: str) -> BinaryIO:
        """A file object reading ahead in blocks of REMOTE_BLOCK_BYTES (for scanning a tar's headers in order); its
        reads raise s3fs's errors, which the caller words."""
        return self._call("opening", name, lambda: self.fs.open(self._key(name), "rb", block_size=REMOTE_BLOCK_BYTES))

    def find(self, suffix: str) -> list[str]:
        keys = self._call("listing", "", lambda: self.fs.find(self._root))
        names = [key[len(self._root) + 1 :] for key in keys if key.endswith(suffix)]
        return sorted(name for name in names if not any(part.startswith(".") for part in name.split("/")))

    def sha256(self, name: str, chunk_bytes: int = 1 << 24) -> str:
        def digest() -> str:
            with self.fs.open(self._key(name), "rb", block_size=chunk_bytes) as handle:
                return sha256_stream(handle, chunk_bytes)

        return self._call("reading", name, digest)

    def make_folders(self, *names: str) -> None:
        """Object storage has no folders: a prefix exists once an object is under it. The bucket must exist."""
        bucket = self._root.split("/", 1)[0]
        if not self._call("checking the bucket of", "", lambda: self.fs.exists(bucket)):
            raise StorageError(f"bucket {bucket} of {self.url} does not exist (or these credentials cannot see it): create it first")

    def staging_path(self, name: str) -> Path:
        """A local temporary file to write `name` into before publish() uploads it."""
        handle, path = tempfile.mkstemp(prefix=f".{Path(name).name}.", suffix=".tmp")
        os.close(handle)
        return Path(path)

    def publish(self, staged: Path, name: str) -> None:
        try:
            self._call("writing", name, lambda: self.fs.put_file(str(staged), self._key(name)))
        finally:
            staged.unlink(missing_ok=True)

    def publish_once(self, staged: Path, name: str) -> bool:
        """A conditional PUT (If-None-Match: *): exactly one writer creates `name`."""
        try:
            self._call("writing", name, lambda: self.fs.put_file(str(staged), self._key(name), mode="create"))
            return True
        except StorageError as error:
            if isinstance(error.__cause__, FileExistsError):
                return False
            raise
        finally:
            staged.unlink(missing_ok=True)

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """`name`'s bytes and an ETag at most as new as they are (None: no such object). A conditional write on
        that ETag succeeds only if the object is still the version read: if it changed in between, the bytes
        are the newer ones and the write fails, so a decision taken on the bytes never overwrites a newer version."""
        try:
            version = self._call("reading", name, lambda: self.fs.info(self._key(name))["ETag"])
            return self.read_bytes(name), version
        except FileNotFoundError:
            return None

    def write_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """Write `name` in one conditional PUT, only if it does not exist (version None: If-None-Match: *) or is
        still the version `version` (If-Match: that ETag); atomic in the service. Returns the new version's ETag,
        or None where the condition failed (another writer came first, or the object is gone)."""
        bucket, key, _ = self.fs.split_path(self._key(name))
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            answer = self._call("writing", name, lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition))
        except FileNotFoundError:  # If-Match on an object deleted meanwhile
            return None
        except StorageError as error:
            if condition_failed(error.__cause__):
                return None
            raise
        return answer["ETag"]

    def remove_if(self, name: str, version: str) -> None:
        """Delete `name` only if it is still the version `version` (If-Match); another version, or none, stays as it is."""
        bucket, key, _ = self.fs.split_path(self._key(name))
        try:
            self._call("deleting", name, lambda: self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version))
        except FileNotFoundError:
            pass
        except StorageError as error:
            if not condition_failed(error.__cause__):
                raise

    def remove_stale_staging(self, name: str) -> None:
        """Nothing to do: staging files are local temporary files, removed by the process that made them."""

    def remove_staging_of(self, folder: str, owner: str) -> None:
        """Nothing to do (see remove_stale_staging)."""

    def remove(self, name: str) -> None:
        try:
            self._call("deleting", name, lambda: self.fs.rm_file(self._key(name)))
        except FileNotFoundError:
            pass

    def move(self, name: str, new_name: str) -> None:
        """Copy, then delete (object storage has no rename); a file another worker moved already is fine."""
        try:
            self._call("moving", name, lambda: self.fs.copy(self._key(name), self._key(new_name)))
        except FileNotFoundError:
            return
        self.remove(name)

    def open_tensors(self, name: str) -> RemoteTensors:
        """The shard's header; its requests raise StorageError, a damaged header DamagedHeader (not the network's fault)."""
        return RemoteTensors(self, name)

    def read_items(self, requests: list[tuple[RemoteTensors, list[str]]]) -> list[dict[str, torch.Tensor]]:
        """Each request's tensors with one ranged request apiece, all of them concurrently."""
        spans = [tensors.span(keys) for tensors, keys in requests]
        paths = [self._key(tensors.name) for tensors, _ in requests]
        bodies = self._call(
            "reading", requests[0][0].name, lambda: self.fs.cat_ranges(paths, [start for start, _ in spans], [end for _, end in spans], on_error="return")
        )
        results = []
        for (tensors, keys), (start, end), body in zip(requests, spans, bodies):
            if isinstance(body, BaseException):
                raise StorageError(f"reading {self.location(tensors.name)} failed: {storage_error_reason(body)}") from body
            if len(body) != end - start:
                raise StorageError(f"reading {self.location(tensors.name)} gave {len(body)} of bytes {start}-{end}: the object is shorter than its header says")
            results.append(tensors.decode(keys, body, start))
        return results
