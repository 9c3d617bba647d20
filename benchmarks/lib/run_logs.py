"""What a trainer run's own log says about its speed (the wall time of each update's train/loss event in its
TensorBoard folder), and the GPU's busy share while it ran (nvidia-smi, sampled beside it)."""

from __future__ import annotations

import math
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def update_times(tensorboard_dir: Path) -> dict[int, float]:
    """Update number -> wall time of its train/loss event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: event.wall_time for event in accumulator.Scalars("train/loss")}


@dataclass
class RunTiming:
    ms_per_update: float  # over the measured window, the save's interval left out
    save_pause_s: float | None  # the save's interval less as many median updates; None if it is not in the window
    updates_measured: int
    window_start: float  # wall time of the window's first logged update


def ms_per_update(times: dict[int, float], measure_from: int, save_at: int) -> RunTiming:
    """Timing from the logged updates' wall times (a run logs every --log_every_n_updates updates, and its last):
    the intervals between consecutive logged updates from the first at or after `measure_from`, each spread over
    the updates it holds; the interval holding the update after the state save at `save_at` is the save's."""
    logged = sorted(update for update in times if update >= measure_from)
    intervals = list(zip(logged, logged[1:]))
    if not intervals:
        raise ValueError(f"fewer than two logged updates from update {measure_from} on (logged: {sorted(times)})")
    saves = [(first, last) for first, last in intervals if first < save_at + 1 <= last]
    steady = [(first, last) for first, last in intervals if (first, last) not in saves]
    updates = sum(last - first for first, last in steady)
    seconds = sum(times[last] - times[first] for first, last in steady)
    per_update = [(times[last] - times[first]) / (last - first) for first, last in steady]
    pause = None
    if saves and per_update:
        first, last = saves[0]
        pause = times[last] - times[first] - (last - first) * statistics.median(per_update)
    return RunTiming(1000 * seconds / updates if updates else math.nan, pause, updates, times[logged[0]])


class GpuBusy:
    """nvidia-smi's GPU utilization, sampled every 100 ms with its time, for the share over a window."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        process = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                                   stdout=subprocess.PIPE, text=True)
        while not self._stop.is_set():
            line = process.stdout.readline()
            if not line:
                break
            try:
                self.samples.append((time.time(), float(line.split(",")[0])))
            except ValueError:
                continue
        process.terminate()

    def share(self, start: float, end: float) -> float | None:
        inside = [busy for moment, busy in self.samples if start <= moment <= end]
        return statistics.fmean(inside) / 100 if inside else None
