"""A thread pool's map in order with a bounded number of items in flight.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator


def bounded_map(pool: ThreadPoolExecutor, function: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map in order, with at most `window` items in flight: decoded images wait in memory only
    as long as the encoders need, however many millions of items there are."""
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
