"""What a multi-day run reports: train.log beside the run, scalars every N updates, validation every N
updates, and Weights & Biases (offline mode) next to TensorBoard. One 2-process run of the trainer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_processes, scalars, trainer_flags

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir) -> tuple[Path, str]:
    output_dir = tmp_path_factory.mktemp("logging")
    os.environ["WANDB_MODE"] = "offline"
    try:
        result = run_processes(
            2,
            REPO_ROOT / "sdxl_FSDP_train.py",
            trainer_flags(
                sample_cache_dir, tiny_pipeline_dir, output_dir, "run",
                "--optimizer", "adamw", "--num_train_epochs", "1", "--no-save_diffusers", "--save_single_file", "--no-save_state",
                "--log_every_n_updates", "2", "--validation_every_n_updates", "3", "--report_to_wandb", "--wandb_project", "tests",
            ),
        )
    finally:
        del os.environ["WANDB_MODE"]
    return output_dir / "run", result.stdout


def test_scalars_every_n_updates_and_at_the_last(logged_run):
    run, stdout = logged_run
    losses = scalars(run, "train/loss")
    rates = scalars(run, "train/lr")
    assert len(losses) == len(rates) >= 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    total_updates = 11
    assert f"{total_updates} optimizer updates" in stdout
    # Every 2nd update, and the run's last (odd) one, so that a run's end is never missing from its log.
    assert [event.step for event in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, total_updates]


def test_validation_every_n_updates_and_at_epochs(logged_run):
    run, stdout = logged_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    updates = 11  # the run's last update: validation ran after it, at the epoch's end
    steps = [event.step for event in events.Scalars("val/loss")]
    assert steps[0] == 0  # the base model
    assert {3, 6, 9} <= set(steps), steps
    assert "Validation (after update 3" in stdout and "Validation (after epoch 1" in stdout
    assert steps[-1] == updates


def test_train_log_holds_the_console_messages(logged_run):
    run, stdout = logged_run
    log = (run / "train.log").read_text()
    assert "cached items, 2 processes" in log and "Validation (after update 3" in log
    assert "\r" not in log  # progress-bar redraws stay on the console
    assert "TensorBoard logs:" in log


def test_weights_and_biases_offline_run_holds_scalars_and_config(logged_run):
    run, _ = logged_run
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    offline_runs = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline_runs) == 1
    # The run's record file (protobuf records, which `wandb sync` uploads); its keys and values are stored as
    # plain strings, and wandb 0.30 ships no Python reader for it.
    records = (offline_runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert records.startswith(b":W&B")
    assert records.count(b"train/loss") >= len(scalars(run, "train/loss"))
    assert b"val/loss" in records and b"train/lr" in records
    assert b"learning_rate" in records and b"0.0001" in records  # the config


def test_single_file_without_the_diffusers_folder(logged_run):
    """--save_single_file --no-save_diffusers used to write nothing and say nothing."""
    run, stdout = logged_run
    assert (run / "pipeline.safetensors").is_file() and not (run / "pipeline").exists()
    assert f"to {run / 'pipeline.safetensors'} in" in stdout
