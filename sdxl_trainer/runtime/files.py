"""Writing files safely: errors that mean "the disk is full", whatever library reports them, and small
files written so that a crash never leaves a torn one."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import sys
from pathlib import Path

from safetensors import SafetensorError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
LOW_SPACE_BYTES = 1 << 30  # less than one SDXL checkpoint shard or export
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: os.umask can only be read by setting it
SHAREABLE_MODE = 0o666 & ~_UMASK


def _is_checkpoint_exception(error: BaseException) -> bool:
    """DCP's CheckpointException (every rank's error of a collective save or load). Looked up, not imported:
    one exists only where DCP is loaded, and importing DCP would cost the caching script's dry run or refused
    start seconds of CPU."""
    checkpoint_api = sys.modules.get("torch.distributed.checkpoint.api")
    return checkpoint_api is not None and isinstance(error, checkpoint_api.CheckpointException)


def _causes(error: BaseException | None):
    """The error, what caused it, and for DCP's CheckpointException every rank's error."""
    seen = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        if _is_checkpoint_exception(current):
            pending += [failure for failure, _ in current.failures.values()]


def is_disk_full(error: BaseException | None) -> bool:
    """OSError ENOSPC/EDQUOT, also when wrapped by DCP or reported by safetensors (SafetensorError is not an
    OSError: its message reads "... No space left on device (os error 28)")."""
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(cause, SafetensorError) and any(f"(os error {number})" in str(cause) for number in DISK_FULL_ERRNOS):
            return True
    return False


def free_bytes(folder: Path) -> int:
    """Free space on the filesystem that holds `folder` (or its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def write_error_reason(error: BaseException | None, folder: Path | None = None) -> str:
    """A one-line reason for a failed write: the disk being full, else the first error's class and message.
    Some writers report a full disk as something else (torch's zip writer: "unexpected pos ..."), so with
    `folder` given, a write that failed where less than LOW_SPACE_BYTES are free counts as a full disk too."""
    if is_disk_full(error) or (folder is not None and free_bytes(folder) < LOW_SPACE_BYTES):
        return "the disk is full"
    for cause in _causes(error):
        if not _is_checkpoint_exception(cause):
            return f"{type(cause).__name__}: {cause}"
    return "another process failed to write its part"


def write_durably(path: Path, text: str) -> None:
    """Write a small file so that a crash leaves the old content or the new one, never a torn one."""
    tmp_path = path.with_name(path.name + ".tmp")
    with open(tmp_path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp_path.replace(path)


def make_shareable(*paths: Path) -> None:
    """Give files the mode any other file the user creates gets (0o666 less the umask: usually readable by
    the group, so a team on a shared filesystem can read caches and models). safetensors creates its files
    0o600 whatever the umask; everything we write with it goes through here. Folders: every file inside."""
    for path in paths:
        files = [path] if path.is_file() else [child for child in path.rglob("*") if child.is_file()]
        for file in files:
            os.chmod(file, SHAREABLE_MODE)


class LockHeld(RuntimeError):
    """Another process holds the lock; str() is its holder as it wrote itself ("process PID on HOST")."""


class ProcessLock:
    """An exclusive flock on `path`, held by this process until release(), with "process PID on HOST" written
    in the file so that a second process can name the first. The kernel releases the lock when the process
    ends however it ends, so a killed process never leaves a stale lock (on NFS this needs its lock service,
    which NFSv4 has). Raises LockHeld if another process holds it."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "another process"
            self._handle.close()
            raise LockHeld(holder) from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self._handle.flush()

    def release(self) -> None:
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
