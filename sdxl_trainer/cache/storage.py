"""Where a cache lives: a local folder, or a prefix in S3-compatible object storage (`s3://bucket/prefix`).

Both stores offer the few operations the cache needs (cache.py), on names relative to the cache's root
('shards/w0000of0001-000000.safetensors'). Writes are crash-safe in both: a local file is written under a
temporary name, fsynced and renamed; an object PUT is all-or-nothing, so object storage (which has no rename)
needs no temporary name. The cache's own commit record, a manifest part written after its shard, does the rest.

Object storage is reached with s3fs. Credentials and region come the standard AWS way (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role); another S3-compatible service (MinIO, Cloudflare R2,
Backblaze B2) is named by AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL. A shard is read with ranged requests: its
safetensors header once, then one request per item covering that item's tensors (a batch's items
concurrently). Every request has a connect and a read timeout and a bounded number of tries (see
REQUEST_ATTEMPTS), so a dropped connection is retried and a stalled endpoint fails within minutes; what still
fails is a StorageError naming the object (and the endpoint, for a timeout).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, TypeVar
from urllib.parse import urlsplit

import torch
from safetensors import safe_open

from sdxl_trainer.runtime.files import LockHeld
from sdxl_trainer.runtime.tensor_files import header_length, parse_header

STALE_TMP_S = 60.0  # a temporary file older than this was left by a killed worker
REMOTE_READ_THREADS = 32  # manifest parts read at once from object storage (each one request)
# A lease object (ObjectLease) is renewed every LEASE_RENEW_S; one not renewed for LEASE_S was left by a killed process.
LEASE_RENEW_S = 60.0
LEASE_S = 300.0
REMOTE_PREFIX = "s3://"
# How long object storage may keep a request waiting. s3fs's own settings wait 15 s per try but try a read 125
# times (botocore's 5 tries inside s3fs's 5, which a read nests twice: around the request and around reading
# its body), so a stalled endpoint (one that takes the connection and never answers) held a read for over
# 30 minutes. With these a stalled read fails after S3FS_TRIES**2 * REQUEST_ATTEMPTS = 12 tries of READ_TIMEOUT_S
# (3 minutes, plus at most 12 s of backoff), a request without a body (size, listing) after 6.
CONNECT_TIMEOUT_S = 10.0  # to open a connection: milliseconds where the endpoint is reachable; a refused one fails at once
READ_TIMEOUT_S = 15.0  # the longest silence within a response (before its first byte or between two): s3fs's default
READ_TIMEOUT_VARIABLE = "SDXL_S3_READ_TIMEOUT_S"  # overrides READ_TIMEOUT_S (seconds): longer for a slow service, short in tests
REQUEST_ATTEMPTS = 3  # botocore's tries of one request, in its "standard" mode: backoff, and retries on throttling and 5xx answers too
S3FS_TRIES = 2  # s3fs's own tries around botocore's; the outer one of a read also retries a connection dropped mid-body
HEADER_PROBE_BYTES = 1 << 18  # the first request for a shard's header reads this much (a 256-item shard's is ~100 KB)
REMOTE_BLOCK_BYTES = 8 << 20  # read-ahead of an object opened as a file: a tar's headers a few images apart cost one request
Result = TypeVar("Result")


class CacheError(RuntimeError):
    """The cache is missing, damaged or was made with other settings; the message says what to do."""


class StorageError(CacheError):
    """Object storage could not be reached or refused a request; the message says what to check."""


class LeaseLost(CacheError):
    """Another process took over this process's ObjectLease; the message names it."""


def sha256_stream(handle: BinaryIO, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(chunk_bytes):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return sha256_stream(handle)


def is_remote(location: str | Path) -> bool:
    return str(location).startswith(REMOTE_PREFIX)


def open_store(location: str | Path | LocalStore | RemoteStore) -> LocalStore | RemoteStore:
    """The store of a cache location: an s3:// URL or a local folder (a store is returned as it is)."""
    if isinstance(location, (LocalStore, RemoteStore)):
        return location
    return RemoteStore(str(location)) if is_remote(location) else LocalStore(Path(location))


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



class ObjectLease:
    """An exclusive lease on the object `name`, for object storage, which has no locks: the object records
    "process PID on HOST" and when it was last renewed (this machine's clock). Every write of it is conditional
    on the version last seen (RemoteStore.write_if), so of two processes taking it at once, or over each other,
    exactly one succeeds. A thread renews it every `renew_s`; a lease not renewed for `lease_s` (its process was
    killed or stalled) is taken over. Raises LockHeld while another process holds it.

    A holder that stalled past `lease_s` may find its lease taken over: its renewal fails, it stops renewing,
    and confirm(), which its work calls before each commit, raises LeaseLost."""

    def __init__(self, store: RemoteStore, name: str, lease_s: float = LEASE_S, renew_s: float = LEASE_RENEW_S):
        self.store, self.name, self.lease_s = store, name, lease_s
        self.holder = f"process {os.getpid()} on {socket.gethostname()}"
        self.token = uuid.uuid4().hex
        self._renewing = threading.Lock()  # the renewer thread and confirm() both write it
        self._lost: LeaseLost | None = None
        self._version = self._take(lease_s)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_every, args=(renew_s,), name=f"lease {name}", daemon=True)
        self._renewer.start()

    def _record(self) -> bytes:
        return json.dumps({"holder": self.holder, "token": self.token, "renewed_at": time.time()}).encode()

    def _read(self) -> tuple[dict, str] | None:
        found = self.store.read_versioned(self.name)
        if found is None:
            return None
        data, version = found
        try:
            record = json.loads(data)
            float(record["renewed_at"])
        except (ValueError, KeyError, TypeError):
            record = {"holder": "an unreadable lease", "renewed_at": 0.0}
        return record, version

    def _take(self, lease_s: float) -> str:
        version = self.store.write_if(self.name, self._record(), None)
        if version is not None:
            return version
        found = self._read()
        if found is None:  # released between the two requests: free again
            version = self.store.write_if(self.name, self._record(), None)
            if version is None:
                raise LockHeld("another process that took the lease just now")
            return version
        current, version = found
        if current.get("token") == self.token:  # this write's answer was lost and its retry refused: it is this process's own
            return version
        age = time.time() - current["renewed_at"]
        if age < lease_s:
            raise LockHeld(f"{current['holder']} (its lease {self.store.location(self.name)} was renewed {age:.0f} s ago; if that process is gone, delete it)")
        version = self.store.write_if(self.name, self._record(), version)  # a killed process's lease, unless another took it first
        if version is None:
            raise LockHeld("another process taking over the same stale lease")
        return version

    def confirm(self) -> None:
        """Renew the lease now: no other process can take it over for `lease_s` from here. Raises LeaseLost if
        another process has taken it over (StorageError if the storage cannot be reached)."""
        with self._renewing:
            if self._lost is None:
                version = self.store.write_if(self.name, self._record(), self._version)
                if version is None:
                    self._lost = self._loss()
                else:
                    self._version = version
            if self._lost is not None:
                raise self._lost

    def _loss(self) -> LeaseLost | None:
        """Why the last renewal failed; None where the lease is still this process's (a renewal whose answer was
        lost and whose retry was refused), its version then taken up."""
        found = self._read()
        if found is not None and found[0].get("token") == self.token:
            self._version = found[1]
            return None
        what = f"was taken over by {found[0]['holder']}" if found is not None else "was deleted"
        return LeaseLost(
            f"the lease {self.store.location(self.name)} {what}, as this process had not renewed it for {self.lease_s:.0f} s (it was "
            "stalled): stopping before its next write, so that two processes do not write the same files"
        )

    def _renew_every(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.confirm()
            except LeaseLost:
                return  # the work stops at its next confirm()
            except StorageError:
                pass  # the next renewal tries again; the lease lasts LEASE_S

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        if self._lost is not None:
            return  # another process's lease now
        try:
            self.store.remove_if(self.name, self._version)
        except StorageError:
            pass  # unreachable storage: the lease lapses by itself after LEASE_S


def storage_error_reason(error: BaseException) -> str:
    """What to check, for the errors object storage gives."""
    name = type(error).__name__
    if name == "NoCredentialsError":
        return (
            "no credentials found. Set them the standard AWS way: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
            "AWS_ENDPOINT_URL_S3 for a service other than AWS (MinIO, R2, B2)"
        )
    if isinstance(error, PermissionError) or name in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"access denied ({error}): check the credentials and that they may read and write this bucket"
    if isinstance(error, FileExistsError):
        return "it exists already"
    if name in ("ReadTimeoutError", "ConnectTimeoutError"):
        url = urlsplit(getattr(error, "kwargs", {}).get("endpoint_url", ""))
        endpoint = f"{url.scheme}://{url.netloc}" if url.netloc else "the endpoint"
        if name == "ConnectTimeoutError":
            return f"could not connect to {endpoint} within {CONNECT_TIMEOUT_S:g} s (after retries): check the network and AWS_ENDPOINT_URL_S3, then re-run"
        return (
            f"no answer from {endpoint} within {read_timeout_s():g} s (after retries): it takes connections but does not respond, as a stalled "
            "server or proxy does; check it and AWS_ENDPOINT_URL_S3, then re-run"
        )
    return f"{name}: {error} (after retries; check the network and AWS_ENDPOINT_URL_S3, then re-run)"


def condition_failed(error: BaseException | None) -> bool:
    """Whether a conditional write was refused because another writer came first: 412 Precondition Failed (s3fs
    makes it a FileExistsError for If-None-Match) or, while two conditional writes race, 409 ConditionalRequestConflict."""
    if isinstance(error, FileExistsError):
        return True
    response = getattr(error, "response", None) or getattr(getattr(error, "__cause__", None), "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")


def read_timeout_s() -> float:
    """READ_TIMEOUT_S, or the value of the environment variable READ_TIMEOUT_VARIABLE."""
    value = os.environ.get(READ_TIMEOUT_VARIABLE, "")
    if not value:
        return READ_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise StorageError(f"{READ_TIMEOUT_VARIABLE}={value!r}: give the object storage read timeout in seconds (> 0), or unset it for {READ_TIMEOUT_S:g}")
    return seconds


def bounded_s3_file_system():
    """An s3fs file system whose requests all end: CONNECT_TIMEOUT_S, read_timeout_s(), REQUEST_ATTEMPTS tries
    each, inside S3FS_TRIES of s3fs's own. No listings cache: other workers add objects while this one runs."""
    import s3fs  # only runs that use object storage pay for importing it

    class BoundedS3FileSystem(s3fs.S3FileSystem):
        retries = S3FS_TRIES  # s3fs takes its own tries from this class attribute only

    return BoundedS3FileSystem(
        use_listings_cache=False,
        skip_instance_cache=True,
        config_kwargs={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": read_timeout_s(),
            "retries": {"total_max_attempts": REQUEST_ATTEMPTS, "mode": "standard"},
        },
    )
