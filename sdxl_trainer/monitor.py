"""Training metrics: TensorBoard on rank 0, peak memory of every rank, and true images/s."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: GPU memory allocated by torch, or CPU resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak_kib / (2**30 if sys.platform == "darwin" else 2**20)


def gather_floats(value: float, device: torch.device) -> list[float]:
    """One float from every rank, in rank order (a collective: every rank must call it)."""
    local = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [tensor.item() for tensor in gathered]


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


class MetricsWriter:
    """TensorBoard scalars and images, written by rank 0 only; other ranks hold a no-op writer."""

    def __init__(self, log_dir: Path, enabled: bool):
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, step)

    def image(self, tag: str, image, step: int) -> None:
        """One RGB image (PIL image or uint8 (H, W, 3) array), e.g. the sample grid under "samples/grid"."""
        if self._writer is not None:
            self._writer.add_image(tag, np.asarray(image), step, dataformats="HWC")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
