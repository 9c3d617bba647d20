"""TensorBoard (and Weights & Biases) scalars and images, written by rank 0; a write the disk refuses costs those
values and one warning, never the run.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdxl_trainer.monitoring.console_log import close_after_a_failed_write

WANDB_ID_FILE = "wandb_run_id.txt"


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
        close_after_a_failed_write(writer)

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
