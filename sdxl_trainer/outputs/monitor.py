"""Training metrics: TensorBoard on rank 0, peak memory of every rank, and true images/s."""

from __future__ import annotations

import resource
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from sdxl_trainer.config import option
from sdxl_trainer.training.step import UpdateResult

WANDB_ID_FILE = "wandb_run_id.txt"

@dataclass(kw_only=True)
class LoggingOptions:
    """Logging"""

    log_dir: Path | None = option(None, help="TensorBoard folder; None = OUTPUT_DIR/PROJECT_NAME/tensorboard")
    log_every_n_updates: int = option(1, help="write the training scalars every N updates (loss and gradient norm averaged over them)")
    report_to_wandb: bool = option(False, help="also log scalars, sample grids and the config to Weights & Biases (run `wandb login` first, or set WANDB_MODE=offline)")
    wandb_project: str = option("sdxl_finetune", help="Weights & Biases project of the run (the run's name is --project_name)")

    def problems(self) -> list[str]:
        return ["--log_every_n_updates must be at least 1"] if self.log_every_n_updates < 1 else []


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: GPU memory allocated by torch, or CPU resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak_kib / (2**30 if sys.platform == "darwin" else 2**20)


def peak_reserved_gib(device: torch.device) -> float | None:
    """Peak GPU memory torch's caching allocator held (allocated plus its cache; above peak_memory_gib by
    what fragmentation costs); None off the GPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def gather_floats(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """One float from every rank, in rank order (a collective over `group`: every rank must call it). On a gloo
    group with device cpu nothing waits for the GPU."""
    local = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.cat(gathered).tolist()


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


@dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases as a second backend. The run id is kept in the run folder, so a resumed training
    run continues the same W&B run; WANDB_MODE=offline writes it locally (sync later with `wandb sync`)."""

    project: str
    run_name: str
    run_dir: Path
    config: dict


class MetricsWriter:
    """TensorBoard scalars and images (and the same in Weights & Biases if asked), written by rank 0 only;
    other ranks hold a no-op writer.

    A write the disk refuses (full, or gone) costs those values and one warning, never the run: TensorBoard's
    writer thread dies on the first error and would raise it at every later write, so it is let go, and a
    write `retry_after_seconds` later opens a new event file beside the earlier ones (TensorBoard reads them
    all; each try on a full disk leaves an empty one)."""

    def __init__(self, log_dir: Path, enabled: bool, wandb_settings: WandbSettings | None = None, retry_after_seconds: float = 60.0):
        self._log_dir = log_dir
        self._enabled = enabled
        self._writer = None
        self._retry_after_seconds = retry_after_seconds
        self._failed_at: float | None = None  # when the last write failed, if none has succeeded since
        self._wandb = None
        if enabled:
            self._writer = self._open_writer()  # a folder that cannot be written stops the start, before any training
            if wandb_settings is not None:
                self._wandb = _start_wandb(wandb_settings)

    def _tensorboard(self, write) -> None:
        if not self._enabled or (self._failed_at is not None and time.monotonic() - self._failed_at < self._retry_after_seconds):
            return
        try:
            if self._writer is None:
                self._writer = self._open_writer()
            write(self._writer)
            self._failed_at = None
        except OSError as error:
            if self._failed_at is None:
                print(f"Warning: could not write TensorBoard logs to {self._log_dir} ({error}). Training goes on; the scalars meanwhile are lost, "
                      f"and logging resumes in a new event file once the disk has room again (tried every {self._retry_after_seconds:g} s).",
                      file=sys.stderr)
            self._failed_at = time.monotonic()
            self._let_go_of_writer()

    def _open_writer(self):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self._log_dir))

    def _let_go_of_writer(self) -> None:
        writer, self._writer = self._writer, None
        _close_after_a_failed_write(writer)

    def scalars(self, values: dict[str, float], step: int) -> None:
        def write(writer) -> None:
            for tag, value in values.items():
                writer.add_scalar(tag, value, step)

        self._tensorboard(write)
        if self._wandb is not None and values:
            self._wandb.log(dict(values), step=step)

    def image(self, tag: str, image, step: int) -> None:
        """One RGB image (PIL image or uint8 (H, W, 3) array), e.g. the sample grid under "samples/grid"."""
        self._tensorboard(lambda writer: writer.add_image(tag, np.asarray(image), step, dataformats="HWC"))
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image(np.asarray(image))}, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._tensorboard(lambda writer: writer.flush())
        self._let_go_of_writer()
        self._enabled = False
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(settings: WandbSettings):
    import wandb

    id_file = settings.run_dir / WANDB_ID_FILE
    run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n", encoding="utf-8")
    return wandb.init(project=settings.project, name=settings.run_name, id=run_id, resume="allow", dir=str(settings.run_dir), config=settings.config)


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
        _close_after_a_failed_write(file)


def _close_after_a_failed_write(file) -> None:
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


class TrainingMonitor:
    """What a run reports: the progress bar and messages (rank 0), the per-update scalars, epoch losses,
    throughput and every rank's peak memory."""

    def __init__(self, metrics: MetricsWriter, total_updates: int, first_update: int, device: torch.device, is_main: bool, host_group: dist.ProcessGroup,
                 every_n_updates: int = 1):
        """Scalars are written every `every_n_updates` updates: loss and gradient norm averaged over them,
        the learning rate and counters as of the last one. `host_group`: a gloo group the allocator's peaks
        are gathered over (CPU tensors: the GPU is never waited for)."""
        self.metrics = metrics
        self.every_n_updates = every_n_updates
        self._unread: list[tuple[int, UpdateResult]] = []  # (update number, its figures still on the device)
        self._since_written: list[tuple[float, float]] = []  # loss and gradient norm of each update read since the last scalars
        self.throughput = Throughput()
        self.device = device
        self.is_main = is_main
        self._epoch_losses: list[float] = []  # of this epoch's updates that stepped, as read so far
        self.progress = tqdm(total=total_updates, initial=first_update, desc="training", unit="update", disable=not is_main, dynamic_ncols=True)
        self._host_group = host_group

    def say(self, message: str) -> None:
        """A message printed once (by rank 0), above the progress bar."""
        if self.is_main:
            tqdm.write(message)

    def log_update(self, update: int, epoch: int, result: UpdateResult) -> None:
        """Called after every update. Its figures stay on the device until the scalars are written (every
        `every_n_updates` updates), when every update's since the last read come in one transfer: the host
        never waits for the device in between. Collective then (every rank's peak memory is gathered)."""
        self._unread.append((update, result))
        self.progress.update()
        if update % self.every_n_updates == 0:
            self._read_unread()
            self._write_scalars(update, result)
            self.progress.set_postfix(epoch=epoch + 1, loss=f"{result.loss:.4f}", img_s=f"{self.throughput.images_per_second:.2f}")

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

    def _write_scalars(self, update: int, last: UpdateResult) -> None:
        losses, grad_norms = zip(*self._since_written)
        self._since_written = []
        # The allocator's peaks are host-side counters: gathered over a gloo group, the GPU is never waited for.
        memory = gather_floats(peak_memory_gib(self.device), torch.device("cpu"), self._host_group)
        reserved = peak_reserved_gib(self.device)
        reserved_by_rank = gather_floats(reserved, torch.device("cpu"), self._host_group) if reserved is not None else []
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

    def log_epoch(self, finished_epochs: int) -> None:
        """The epoch's mean loss over the updates that stepped (reads the updates not read yet)."""
        self._read_unread()
        if self._epoch_losses:
            self.metrics.scalars({"train/epoch_loss": sum(self._epoch_losses) / len(self._epoch_losses)}, finished_epochs)
        self._epoch_losses = []

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
