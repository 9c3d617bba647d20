"""Handing back to the system what a start-up step freed. Reading a manifest of millions of items takes
several times the memory the dataset keeps; the allocators keep what was freed for later use, and train.sh's
MALLOC_TRIM_THRESHOLD_ (which keeps what an update frees for the next one) stops glibc from ever trimming
less than 1 GiB, so the start's peak would stay resident for the whole run in every rank."""

from __future__ import annotations

import ctypes

import pyarrow as pa


def release_freed_memory() -> None:
    """Return the free pages of Arrow's memory pool and, where the C library is glibc, of malloc's heaps."""
    pa.default_memory_pool().release_unused()
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if malloc_trim is not None:
        malloc_trim(0)
