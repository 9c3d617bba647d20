"""True images per second: time in training updates only, and the share of it spent waiting for data."""

from __future__ import annotations

import time


class Throughput:
    """Images per second averaged over time spent in training updates only (not start-up or saving), and
    the share of that time spent waiting for the data loader."""

    def __init__(self) -> None:
        self.images = 0
        self.seconds = 0.0
        self.data_seconds = 0.0
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def data_ready(self) -> None:
        """Call once the update's batches are in hand: the time since start() was data loading."""
        assert self._started is not None, "Throughput.data_ready() without start()"
        self.data_seconds += time.perf_counter() - self._started

    def stop(self, images: int) -> None:
        assert self._started is not None, "Throughput.stop() without start()"
        self.seconds += time.perf_counter() - self._started
        self.images += images
        self._started = None

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    @property
    def data_wait_share(self) -> float:
        return self.data_seconds / self.seconds if self.seconds else 0.0
