"""train.log: rank 0's console messages also appended to a file in the run folder."""

from __future__ import annotations

import sys
from pathlib import Path


class ConsoleLog:
    """Rank 0's console messages, also appended to a plain text file (train.log in the run folder); the
    progress bar's redraws (lines with carriage returns) stay on the console only."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled
        self._file: _LogFile | None = None
        self._originals: tuple = ()

    def __enter__(self) -> ConsoleLog:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._originals = (sys.stdout, sys.stderr)
            self._file = _LogFile(self.path, console=sys.stderr)
            sys.stdout, sys.stderr = (_Tee(stream, self._file) for stream in self._originals)
        return self

    def write_to_file_only(self, text: str) -> Path | None:
        """Append `text` to the file only, not the console (what a message there points to: a traceback); the
        file, or None where there is none (not rank 0, or the disk refused a write)."""
        if self._file is None or self._file.failed:
            return None
        self._file.write(text if text.endswith("\n") else text + "\n")
        self._file.flush()
        return None if self._file.failed else self.path

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            sys.stdout, sys.stderr = self._originals
            self._file.close()
            self._file = None


class _LogFile:
    """train.log, appended to until the disk refuses a write (full, or gone): then one warning on the console
    and no more writes, so a print never ends the run. The console keeps every message."""

    def __init__(self, path: Path, console):
        self.path = path
        self._console = console
        self._file = open(path, "a", encoding="utf-8", buffering=1)

    @property
    def failed(self) -> bool:
        """The disk refused a write: nothing more goes into the file."""
        return self._file is None

    def write(self, text: str) -> None:
        self._guarded(lambda file: file.write(text))

    def flush(self) -> None:
        self._guarded(lambda file: file.flush())

    def _guarded(self, action) -> None:
        if self._file is None:
            return
        try:
            action(self._file)
        except OSError as error:
            self.close()
            self._console.write(f"Warning: could not append to {self.path} ({error}). Every message still reaches the console; "
                                f"{self.path.name} gets none from here on.\n")

    def close(self) -> None:
        file, self._file = self._file, None
        close_after_a_failed_write(file)


def close_after_a_failed_write(file) -> None:
    """Close a log file (or TensorBoard writer) that may have failed a write: closing flushes, which fails the
    same way, and what it held is lost, as the warning said."""
    if file is not None:
        try:
            file.close()
        except OSError:
            pass


class _Tee:
    def __init__(self, stream, log_file: _LogFile):
        self._stream = stream
        self._log_file = log_file

    def write(self, text: str) -> int:
        if "\r" not in text:
            self._log_file.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        self._log_file.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
