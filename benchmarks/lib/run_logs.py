"""What a trainer run's own log says about its speed (the wall time of each update's train/loss event in its
TensorBoard folder), and the GPU's busy share while it ran (nvidia-smi, sampled beside it)."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from pathlib import Path


def update_times(tensorboard_dir: Path) -> dict[int, float]:
    """Update number -> wall time of its train/loss event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: event.wall_time for event in accumulator.Scalars("train/loss")}


def ms_per_update(times: dict[int, float], measure_from: int, save_at: int) -> tuple[float, float | None, int]:
    """(ms per update over the updates after `measure_from` but the one after the state save at `save_at`, the
    save's pause in s (that update less the median one; None if it is not in the window), updates measured)."""
    durations = {update: times[update] - times[update - 1] for update in sorted(times) if update - 1 in times and update > measure_from}
    steady = [seconds for update, seconds in durations.items() if update != save_at + 1]  # the save follows update save_at
    pause = durations[save_at + 1] - statistics.median(steady) if save_at + 1 in durations and steady else None
    return 1000 * statistics.fmean(steady), pause, len(steady)


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
