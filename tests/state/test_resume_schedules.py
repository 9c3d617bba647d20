"""Stop and resume is invisible for every schedule: the schedule is a pure function of the update number,
which the trainer computes the same way straight and resumed, so the schedules are checked against the
trainer's own function in this process; the 2-process run resumed bitwise on the richest one (warm-up,
cosine decay and a restart) is test_checkpoint.py's. On 1 process, a run capped by --max_train_updates
resumes into a longer one exactly, and a --learning_rate changed on resume applies from the next update;
the schedules are diffusers'. `train` is the 2-process run that the resumes of trained text encoders and
of masked, flipped, weighted runs are checked on."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, run_processes, scalars, trainer_flags
from diffusers.optimization import get_scheduler
from trainer_runs import RESUME_AT, TOTAL_UPDATES, exported_unet, trainer_schedule

from sdxl_trainer.training.lr_schedule import SCHEDULE_NAMES, LearningRateSchedule


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_schedule_resumes_as_a_function_of_the_update_alone(schedule):
    """What a resumed run can differ in is the schedule's inputs: a schedule built afresh (as on resume) gives
    every later update the rate the straight run's gave it, and holds no state a resume could lose."""
    straight_schedule, resumed_schedule = trainer_schedule(schedule), trainer_schedule(schedule)
    straight_rates = [straight_schedule(update) for update in range(TOTAL_UPDATES)]
    assert [resumed_schedule(update) for update in reversed(range(RESUME_AT, TOTAL_UPDATES))] == straight_rates[:RESUME_AT - 1:-1]
    assert dataclasses.is_dataclass(straight_schedule) and type(straight_schedule).__dataclass_params__.frozen
    if schedule != "constant":
        assert straight_rates[0] == 0.0 and len(set(straight_rates)) > 2  # a warm-up from 0, then it moves



@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_schedules_match_diffusers(schedule):
    peak, warmup, total = 3e-4, 7, 40
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    extra = {"num_cycles": 3} if schedule == "cosine_with_restarts" else {}
    reference = get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=total, power=2.0, **extra)
    ours = LearningRateSchedule(schedule, peak, warmup, total, num_cycles=3, polynomial_power=2.0)
    for update in range(total + 3):
        assert ours(update) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-18), update
        optimizer.step()
        reference.step()



def capped_run(run_root: Path, cache_dir: Path, pipeline_dir: Path, max_updates: int, *extra: str) -> Path:
    """--max_train_updates (kohya's --max_train_steps) on 1 process, constant schedule, in an epoch of more than 20 updates."""
    flags = trainer_flags(cache_dir, pipeline_dir, run_root, "run", "--optimizer", "adamw", "--learning_rate_scheduler", "constant",
                          "--max_train_updates", str(max_updates), "--num_train_epochs", "1", "--save_diffusers", *extra)
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", flags)
    assert f"until update {max_updates} (--max_train_updates; in 1 epoch)" in result.stdout
    return run_root / "run"



@pytest.fixture(scope="module")
def capped_and_longer(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir) -> tuple[Path, Path]:
    """A run capped at update 5 and the same run capped at 9, straight."""
    return (capped_run(tmp_path_factory.mktemp("capped"), sample_cache_dir, tiny_pipeline_dir, 5),
            capped_run(tmp_path_factory.mktemp("longer"), sample_cache_dir, tiny_pipeline_dir, 9))



@pytest.mark.multiprocess
def test_a_run_of_so_many_updates_stops_inside_an_epoch_validates_exports_and_a_longer_resume_goes_on_exactly(
    capped_and_longer, tmp_path, sample_cache_dir, tiny_pipeline_dir
):
    """5 updates, then the same run resumed with --max_train_updates 9 equals 9 straight in its last 4 losses
    and its weights (the schedule spans the cap; like --learning_rate, a resume may change it)."""
    short, straight = capped_and_longer
    assert len(scalars(short, "train/loss")) == 5
    assert len(scalars(short, "val/loss")) == 2  # the base model's, and after update 5 (inside epoch 1)
    assert (short / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (short / "checkpoints" / "update_00000005").is_dir()
    shutil.copytree(short, tmp_path / "run")
    resumed = capped_run(tmp_path, sample_cache_dir, tiny_pipeline_dir, 9, "--load_saved_state", "latest")
    assert scalars(resumed, "train/loss")[5:] == scalars(straight, "train/loss")[5:]
    assert all(torch.equal(weight, exported_unet(straight)[key]) for key, weight in exported_unet(resumed).items())



@pytest.mark.multiprocess
def test_a_learning_rate_lowered_on_resume_applies_from_the_next_update(capped_and_longer, tmp_path, sample_cache_dir, tiny_pipeline_dir):
    short, straight = capped_and_longer
    shutil.copytree(short, tmp_path / "run")
    lowered = capped_run(tmp_path, sample_cache_dir, tiny_pipeline_dir, 9, "--load_saved_state", "latest", "--learning_rate", "5e-5")
    assert scalars(lowered, "train/lr") == pytest.approx(scalars(straight, "train/lr")[:5] + [5e-5] * 4, rel=1e-6)
    assert scalars(straight, "train/lr") == pytest.approx([1e-4] * 9, rel=1e-6)
