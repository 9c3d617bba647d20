"""What a run reports while it trains: the progress bar, the per-update scalars (every --log_every_n_updates),
epoch losses, throughput and every rank's peak memory."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from sdxl_trainer.config import option
from sdxl_trainer.distributed.world import all_gather_floats
from sdxl_trainer.monitoring.memory_peaks import peak_memory_gib, peak_reserved_gib
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter
from sdxl_trainer.monitoring.throughput import Throughput
from sdxl_trainer.training.step import UpdateResult


@dataclass(kw_only=True)
class LoggingOptions:
    """Logging"""

    log_dir: Path | None = option(None, help="TensorBoard folder; None = OUTPUT_DIR/PROJECT_NAME/tensorboard")
    log_every_n_updates: int = option(
        10,
        help="write the training scalars every N updates (loss and gradient norm averaged over them; torchtitan's cadence): only these "
        "updates read the GPU's figures back and exchange anything between the processes (peak memory, a stop request), so the others "
        "never make the host wait, and a stop signal (SIGTERM, Ctrl-C) takes effect at the next of them",
    )
    report_to_wandb: bool = option(False, help="also log scalars, sample grids and the config to Weights & Biases (run `wandb login` first, or set WANDB_MODE=offline)")
    wandb_project: str = option("sdxl_finetune", help="Weights & Biases project of the run (the run's name is --project_name)")

    def problems(self) -> list[str]:
        return ["--log_every_n_updates must be at least 1"] if self.log_every_n_updates < 1 else []


class TrainingMonitor:
    """What a run reports: the progress bar and messages (rank 0), the per-update scalars, epoch losses,
    throughput and every rank's peak memory."""

    def __init__(self, metrics: MetricsWriter, total_updates: int, first_update: int, device: torch.device, is_main: bool, host_group: dist.ProcessGroup,
                 every_n_updates: int = 1):
        """Scalars are written every `every_n_updates` updates and at the run's last one: loss and gradient norm
        averaged over them, the learning rate and counters as of the last one. `host_group`: a gloo group the
        log's exchange runs over (CPU tensors: the GPU is never waited for)."""
        self.metrics = metrics
        self.every_n_updates = every_n_updates
        self.total_updates = total_updates
        self._unread: list[tuple[int, UpdateResult]] = []  # (update number, its figures still on the device)
        self._since_written: list[tuple[float, float]] = []  # loss and gradient norm of each update read since the last scalars
        self.throughput = Throughput()
        self.device = device
        self.is_main = is_main
        self._epoch_losses: list[float] = []  # of this epoch's updates that stepped, as read so far
        self.progress = tqdm(total=total_updates, initial=first_update, desc="training", unit="update", disable=not is_main, dynamic_ncols=True)
        self._host_group = host_group

    def say(self, message: str) -> None:
        """A message printed once (by rank 0), above the progress bar, and flushed: stdout into a pipe or a file (a
        launcher's, `| tee`) holds it in a buffer otherwise, where another rank's message (a stop) can overtake it."""
        if self.is_main:
            tqdm.write(message)
            sys.stdout.flush()

    def log_update(self, update: int, epoch: int, result: UpdateResult, stop_requested: bool = False) -> bool:
        """Called after every update. Its figures stay on the device until the scalars are written (every
        `every_n_updates` updates and the last), when every update's since the last read come in one transfer: the host
        never waits for the device in between. Collective then: one exchange over the host group gives every
        rank's peak memory and whether any rank's stop was requested (`stop_requested`: this rank's), which it
        returns; False on the updates that do not log, which exchange nothing."""
        self._unread.append((update, result))
        self.progress.update()
        if update % self.every_n_updates != 0 and update != self.total_updates:
            return False
        self._read_unread()
        stop_agreed = self._write_scalars(update, result, stop_requested)
        self.progress.set_postfix(epoch=epoch + 1, loss=f"{result.loss:.4f}", img_s=f"{self.throughput.images_per_second:.2f}")
        return stop_agreed

    def _read_unread(self) -> None:
        """The figures of the updates not read yet, in one transfer: into the averages of the next scalars and
        the epoch's loss, with a warning for each skipped update."""
        UpdateResult.read_together([result for _, result in self._unread])
        for update, result in self._unread:
            self._since_written.append((result.loss, result.grad_norm))
            if result.stepped:
                self._epoch_losses.append(result.loss)
            else:
                self.say(f"Warning: update {update} skipped: loss {result.loss}, gradient norm {result.grad_norm} (NaN/inf).")
        self._unread = []

    def _write_scalars(self, update: int, last: UpdateResult, stop_requested: bool) -> bool:
        """The scalars since the last ones, after the log's one exchange between the ranks; returns whether any
        rank asked to stop."""
        losses, grad_norms = zip(*self._since_written)
        self._since_written = []
        # Host-side values (the allocator's peak counters, the stop flag), gathered over a gloo group of CPU
        # tensors: the GPU is never waited for.
        reserved = peak_reserved_gib(self.device)
        by_rank = all_gather_floats([peak_memory_gib(self.device), math.nan if reserved is None else reserved, float(stop_requested)], self._host_group)
        memory = [row[0] for row in by_rank]
        reserved_by_rank = [row[1] for row in by_rank] if reserved is not None else []
        self.metrics.scalars(
            {
                "train/loss": float(np.mean(losses)),
                "train/lr": last.learning_rate,
                "train/grad_norm": float(np.mean(grad_norms)),
                "train/skipped_updates": last.skipped_updates,
                "perf/images_per_s": self.throughput.images_per_second,
                "perf/data_wait_share": self.throughput.data_wait_share,
                **{f"perf/peak_memory_gib/rank{rank}": value for rank, value in enumerate(memory)},
                **{f"perf/peak_reserved_gib/rank{rank}": value for rank, value in enumerate(reserved_by_rank)},
            },
            update,
        )
        return any(row[2] for row in by_rank)

    def log_epoch(self, finished_epochs: int) -> None:
        """The epoch's mean loss over the updates that stepped (reads the updates not read yet)."""
        self._read_unread()
        if self._epoch_losses:
            self.metrics.scalars({"train/epoch_loss": sum(self._epoch_losses) / len(self._epoch_losses)}, finished_epochs)
        self._epoch_losses = []

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
