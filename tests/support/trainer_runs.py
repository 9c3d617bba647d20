"""The 2-process trainer run that resume tests compare against (straight, then resumed from a copy of its folder).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from conftest import REPO_ROOT, run_processes, trainer_flags
from safetensors.torch import load_file

from sdxl_trainer.config import parse_config
from sdxl_trainer.jobs.train_config import TrainConfig, learning_rate_schedule
from sdxl_trainer.training.lr_schedule import LearningRateSchedule

RESUME_AT = 2  # of 6 updates: inside the warm-up (3 updates) and in the middle of the first epoch
TOTAL_UPDATES = 6
# Caption mode with every caption variation on (test_captions.py, test_text_encoder_training.py).
VARIATION_FLAGS = ("--encode_captions_each_step", "--shuffle_caption", "--keep_tokens", "1", "--caption_tag_dropout_rate", "0.3")
SCHEDULE_FLAGS = ("--percent_lr_warm_up_steps", "0.5", "--lr_num_cycles", "2", "--polynomial_power", "2")


def train(run_root: Path, cache_dir: Path | list[Path], pipeline_dir: Path, schedule: str, *extra: str) -> Path:
    # Accumulation 5 over 12 batches an epoch: updates of 5, 5 and 2 microbatches, 6 updates in 2 epochs.
    run_processes(
        2,
        REPO_ROOT / "sdxl_FSDP_train.py",
        [
            *trainer_flags(cache_dir, pipeline_dir, run_root, "run", "--optimizer", "adamw", "--no-validation_loss", "--save_diffusers"),
            "--learning_rate_scheduler", schedule, *SCHEDULE_FLAGS, "--gradient_accumulation_steps", "5", "--num_train_epochs", "2",
            "--save_state_every_n_updates", str(RESUME_AT), "--checkpoints_total_limit", "0", "--save_precision", "fp32",
            *extra,
        ],
    )
    return run_root / "run"


def resumed_copy(straight_run: Path, run_root: Path) -> None:
    """The straight run's folder as it was right after update RESUME_AT was saved."""
    shutil.copytree(straight_run, run_root / "run", ignore=shutil.ignore_patterns("tensorboard", "pipeline", "update_*"))
    checkpoint = f"update_{RESUME_AT:08d}"
    shutil.copytree(straight_run / "checkpoints" / checkpoint, run_root / "run" / "checkpoints" / checkpoint)


def exported_unet(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")


def trainer_schedule(schedule: str, total_updates: int = TOTAL_UPDATES) -> LearningRateSchedule:
    """The schedule the trainer builds for a run of `total_updates` with SCHEDULE_FLAGS and lr 1e-4."""
    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "unused", "--learning_rate", "1e-4", "--learning_rate_scheduler", schedule, *SCHEDULE_FLAGS])
    return learning_rate_schedule(config, total_updates)
