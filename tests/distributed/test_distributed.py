"""The trainer on 2 CPU processes (gloo): each rank holds half the UNet; training with AdamW gives the same
weights (within 1e-5; docs/design.md §1 says what holds for the other optimizers) and the same learning rate at every
update as 1 process on the same data (same global batch, same seed);
a run whose updates keep going NaN stops with state saved, and training never loads the VAE or the text
encoders."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from conftest import REPO_ROOT, SAMPLE_RESOLUTION_FLAGS, run_processes, scalars, train_sample_run, trainer_flags
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess


def test_each_rank_holds_half_of_the_unet(tmp_path, tiny_pipeline_dir):
    run_processes(2, REPO_ROOT / "tests" / "support" / "fsdp_shard_worker.py", [str(tiny_pipeline_dir), str(tmp_path)])
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    full_bytes = reports[0]["full_bytes"]
    assert all(report["all_dtensor"] and report["placements"] == ["(Shard(dim=0),)"] for report in reports)
    shares = [report["local_bytes"] / full_bytes for report in reports]
    # Dim-0 sharding pads odd-sized rows, so a rank may hold a little more than exactly half.
    assert all(0.45 <= share <= 0.55 for share in shares), shares
    assert abs(sum(report["local_bytes"] for report in reports) - full_bytes) / full_bytes < 0.02
    print(f"per-rank parameter share: {shares}")


def test_two_processes_train_like_one(runs_on_one_and_two_processes, tiny_pipeline_dir):
    base = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    one, two = (load_file(run / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors") for run in runs_on_one_and_two_processes.values())
    assert one.keys() == two.keys() == base.keys()
    moved = max((one[key] - base[key]).abs().max().item() for key in base)
    differs = max((one[key] - two[key]).abs().max().item() for key in base)
    print(f"largest weight change from training: {moved:.3e}; largest 1-vs-2-process difference: {differs:.3e}")
    assert moved > 1e-4  # training really changed the weights (several updates at lr 1e-4)
    assert differs < 1e-5, f"1 and 2 processes diverged by {differs}"


def test_learning_rate_depends_only_on_updates(runs_on_one_and_two_processes):
    one, two = (scalars(run, "train/lr") for run in runs_on_one_and_two_processes.values())
    assert one == two
    total = len(one)
    warmup = math.ceil(0.25 * total)
    assert total >= 4 and warmup >= 2
    # Linear warmup from 0 over the first `warmup` updates, the peak at update `warmup`, then cosine decay.
    assert one[:warmup + 1] == pytest.approx([1e-4 * update / warmup for update in range(warmup + 1)], rel=1e-5)
    assert all(later < earlier for earlier, later in zip(one[warmup:], one[warmup + 1:]))


def test_set_seed_seeds_the_global_generators_of_every_rank(runs_on_one_and_two_processes, sample_cache_dir, tiny_pipeline_dir, tmp_path):
    """The trainer's own draws use generators of their own, but Python's and NumPy's global ones were seeded by the
    OS, so a library drawing from them did not repeat with --set_seed. Two runs with the same seed now end with the
    same torch, NumPy and Python global states on each rank (as their checkpoints record them), and the ranks'
    states differ from each other."""
    from sdxl_trainer.state.checkpoints_folder import find_latest_checkpoint
    from sdxl_trainer.state.rng_states import rng_file

    train_sample_run(2, 1, sample_cache_dir, tiny_pipeline_dir, tmp_path)  # the reference run's flags, --set_seed 7
    first, again = (find_latest_checkpoint(run / "checkpoints")[0] for run in (runs_on_one_and_two_processes[2], tmp_path / "run"))
    assert first.name == again.name
    for rank in range(2):
        assert rng_file(first, rank).read_bytes() == rng_file(again, rank).read_bytes(), f"rank {rank}'s generators differ between the runs"
    assert rng_file(again, 0).read_bytes() != rng_file(again, 1).read_bytes()


# (--log_every_n_updates, the update the run stops at, its skipped updates, train/skipped_updates as logged): the
# skips are counted on the device and read when the scalars are written, so the stop waits for that read.
STOP_AFTER_SKIPS = [(1, 3, 2, [0, 1, 2]), (2, 4, 3, [1, 3])]


@pytest.mark.parametrize("log_every, stop_update, skipped, logged", STOP_AFTER_SKIPS, ids=["logging every update", "logging every 2nd update"])
def test_updates_that_keep_failing_stop_the_run_after_saving_state(tmp_path, sample_cache_dir, tiny_pipeline_dir, log_every, stop_update, skipped, logged):
    """A learning rate of 1e30 blows the weights up after one update. The copied pipeline has no VAE or
    text-encoder weights at all (only their config files): training from a cache must not need them."""
    unet_only = tmp_path / "unet_only"
    shutil.copytree(tiny_pipeline_dir, unet_only)
    for folder in ("vae", "text_encoder", "text_encoder_2"):
        for weights in (unet_only / folder).glob("*.safetensors"):
            weights.unlink()
    result = run_processes(
        2,
        REPO_ROOT / "sdxl_FSDP_train.py",
        [
            "--cached_dataset_dirs", str(sample_cache_dir),
            "--pretrained_model_name_or_path", str(unet_only),
            *SAMPLE_RESOLUTION_FLAGS,
            "--optimizer", "adamw", "--learning_rate", "1e30", "--learning_rate_scheduler", "constant",
            "--mixed_precision", "fp32", "--no-save_samples", "--no-validation_image", "--dataloader_num_workers", "0", "--set_seed", "1",
            "--max_consecutive_skipped_updates", "2", "--log_every_n_updates", str(log_every), "--no-save_diffusers",
            "--output_dir", str(tmp_path), "--project_name", "run",
        ],
        expect_success=False,
    )
    assert result.returncode != 0
    assert f"Stopped at update {stop_update}: the last {skipped} updates all had a NaN/inf loss or gradient" in result.stderr
    assert all(f"Warning: update {update} skipped: loss nan" in result.stdout + result.stderr for update in range(2, stop_update + 1))
    # lr 1e30 from the first update: no checkpoint holds weights from before it
    assert f"No checkpoint from before update 1 is in {tmp_path / 'run' / 'checkpoints'}" in result.stderr
    assert "start again from the base model with a lower --learning_rate" in result.stderr
    checkpoint = tmp_path / "run" / "checkpoints" / f"update_{stop_update:08d}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert (state["update"], state["skipped_updates"], state["consecutive_skipped_updates"]) == (stop_update, skipped, skipped)
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    assert scalars(tmp_path / "run", "train/skipped_updates") == logged
    assert not (tmp_path / "run" / "pipeline").exists()


def test_a_run_that_diverges_keeps_its_last_good_checkpoint_and_names_it(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """A finite update can blow the weights up; the updates after it are skipped (NaN) and change nothing, so every
    checkpoint from that update on holds the weights that fail. Reproduced: warm-up makes update 1's rate 0 (its
    checkpoint holds sane weights) and update 2's 5e29, which has a finite loss; 3 and 4 are skipped and the run
    stops. With --checkpoints_total_limit 2 the saves of updates 3 and 4 rotated the sane checkpoint out, and the
    stop named update_4, whose weights are the broken ones, printed before the save line it refers to (stdout was
    still buffered when the stop went to stderr). Now the checkpoints saved in the streak never count against the
    last one from before the update it started from, which the stop names."""
    flags = trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "diverging", "--optimizer", "adamw", "--learning_rate", "1e30",
                          "--learning_rate_scheduler", "constant_with_warmup", "--percent_lr_warm_up_steps", "0.01", "--max_consecutive_skipped_updates", "2",
                          "--save_state_every_n_updates", "1", "--checkpoints_total_limit", "2")
    result = run_processes(2, REPO_ROOT / "sdxl_FSDP_train.py", flags, expect_success=False, merge_output=True)
    output = result.stdout
    assert result.returncode == 1, output[-3000:]
    checkpoints = tmp_path / "diverging" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["update_00000001", "update_00000003", "update_00000004"]
    assert [json.loads((checkpoints / name / "trainer_state.json").read_text())["consecutive_skipped_updates"]
            for name in ("update_00000001", "update_00000003", "update_00000004")] == [0, 1, 2]
    stop = output[output.index("Stopped at update 4"):].strip()
    assert stop.startswith("Stopped at update 4: the last 2 updates all had a NaN/inf loss or gradient and were skipped, so the weights are "
                           "still those of update 2, which they all started from.")
    assert f"Resume from {checkpoints / 'update_00000001'}, the last checkpoint from before update 2, with a lower --learning_rate" in stop
    assert f"The state at the stop is in {checkpoints / 'update_00000004'} (its weights are the ones that failed)." in stop
    assert output.index(f"Saved state to {checkpoints / 'update_00000004'}") < output.index("Stopped at update 4")
