"""The errors a cache raises: each message says what to do."""

from __future__ import annotations


class CacheError(RuntimeError):
    """The cache is missing, damaged or was made with other settings; the message says what to do."""


class StorageError(CacheError):
    """Object storage could not be reached or refused a request; the message says what to check."""
