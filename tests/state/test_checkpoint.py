"""Checkpoints: exact resume of the trainer (on the richest schedule, with every timestep-sampling and loss
option), resharding, a save killed halfway, signals, the checkpoints folder, single-file export/import, and
the pipeline handoff. Distributed parts run on 2 CPU processes."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, SAMPLE_RESOLUTION_FLAGS, process_data_dir, run_processes, scalars, trainer_flags
from safetensors.torch import load_file
from trainer_runs import SCHEDULE_FLAGS, trainer_schedule

from sdxl_trainer.state.checkpoint_layout import METADATA_FILE, TRAINER_STATE_FILE
from sdxl_trainer.state.checkpoints_folder import checkpoint_name, complete_checkpoints, find_latest_checkpoint, remove_old_checkpoints
from sdxl_trainer.state.run_folder import RUN_LOCK_FILE, RunFolderLock
from sdxl_trainer.state.trainer_state import read_trainer_state
from sdxl_trainer.training.epochs import EpochPlanner

TRAINER = REPO_ROOT / "sdxl_FSDP_train.py"
WORKER = REPO_ROOT / "tests" / "support" / "reshard_worker.py"
UNET_FILE = Path("pipeline") / "unet" / "diffusion_pytorch_model.safetensors"


# ---- exact resume of the trainer ---------------------------------------------------------------------


TOTAL_UPDATES = 14
RESUMED_SCHEDULE = "cosine_with_restarts"  # warm-up (7 updates), decay and a restart after the resume at update 5
# Biased logit-normal timesteps, pseudo-Huber loss with Min-SNR and debiased estimation, input perturbation and
# a noise offset, both at random strengths: every draw follows (seed, epoch, sample), so resume stays bitwise.
OBJECTIVE_OPTIONS = (
    "--timestep_sampling", "logit_normal", "--logit_mean", "0.3", "--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "2",
    "--loss_type", "huber", "--huber_schedule", "snr", "--min_snr_gamma", "5", "--debiased_estimation_loss",
    "--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength", "--noise_offset", "0.05", "--noise_offset_random_strength",
)


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir):
    """14 updates straight, into the second epoch of 11 (state every 5 updates and at the end, all kept), and
    the same run resumed from update 5 (inside epoch 1 and the warm-up) into another project that keeps only
    the newest 2 checkpoints. The pair that shows exact resume: on the richest schedule (test_resume_schedules.py
    checks every schedule as the trainer's function of the update) with every timestep-sampling and loss
    option, 8-bit AdamW, the EMA and gradient checkpointing."""
    output_dir = tmp_path_factory.mktemp("resume")
    common = ["--num_train_epochs", "2", "--max_train_updates", str(TOTAL_UPDATES), "--optimizer", "adamw8bit", "--use_ema", "--ema_decay", "0.9",
              "--learning_rate_scheduler", RESUMED_SCHEDULE, *SCHEDULE_FLAGS, *OBJECTIVE_OPTIONS,
              "--save_state_every_n_updates", "5", "--save_diffusers", "--gradient_checkpointing"]  # the exports compared, as users train
    straight = run_processes(2, TRAINER, trainer_flags(sample_cache_dir, tiny_pipeline_dir, output_dir, "straight", *common, "--checkpoints_total_limit", "0"))
    resume_from = output_dir / "straight" / "checkpoints" / checkpoint_name(5)
    resumed = run_processes(
        2, TRAINER,
        trainer_flags(sample_cache_dir, tiny_pipeline_dir, output_dir, "resumed", *common, "--checkpoints_total_limit", "2", "--load_saved_state", str(resume_from)),
    )
    return output_dir, straight.stdout, resumed.stdout


@pytest.mark.multiprocess
def test_resumed_run_ends_with_exactly_the_weights_losses_and_rates_of_the_straight_run(straight_and_resumed, tiny_pipeline_dir):
    output_dir, _, resumed_log = straight_and_resumed
    assert "Resumed from" in resumed_log and "update 5, epoch 1 after 5 of its updates" in resumed_log
    config = json.loads((output_dir / "straight" / "config.json").read_text())
    assert (config["loss_type"], config["timestep_sampling"], config["ip_noise_gamma_random_strength"]) == ("huber", "logit_normal", True)
    straight_run, resumed_run = output_dir / "straight", output_dir / "resumed"
    assert scalars(resumed_run, "train/lr") == scalars(straight_run, "train/lr")[5:]
    assert scalars(resumed_run, "train/loss") == scalars(straight_run, "train/loss")[5:]
    straight = load_file(straight_run / UNET_FILE)
    resumed = load_file(resumed_run / UNET_FILE)
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after resume"
    base = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(tensor, base[name]) for name, tensor in straight.items())  # training moved the weights


@pytest.mark.multiprocess
def test_the_exported_pipeline_encodes_the_empty_caption_as_training_did(straight_and_resumed, sample_cache_dir):
    """Caption dropout trained the encoded "" (the cache's empty_prompt); the stock SDXL pipeline config puts
    zeros in its place when no negative prompt is given, embeddings the fine-tune never saw."""
    from diffusers import StableDiffusionXLPipeline

    from sdxl_trainer.cache.reader import read_empty_prompt

    output_dir, _, _ = straight_and_resumed
    pipeline = StableDiffusionXLPipeline.from_pretrained(output_dir / "straight" / "pipeline")
    assert pipeline.config.force_zeros_for_empty_prompt is False
    _, negative, _, negative_pooled = pipeline.encode_prompt("a photo", do_classifier_free_guidance=True)
    trained_empty, trained_empty_pooled = read_empty_prompt(sample_cache_dir)  # stored in fp16
    assert torch.allclose(negative[0], trained_empty.float(), atol=2e-3, rtol=2e-3)
    assert torch.allclose(negative_pooled[0], trained_empty_pooled.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.multiprocess
def test_train_lr_is_the_rate_each_update_used_also_with_torchaos_tensor_rate(straight_and_resumed):
    """torchao keeps the learning rate in a tensor; logging that tensor logged whatever the schedule wrote into
    it afterwards (the next update's rate)."""
    output_dir, _, _ = straight_and_resumed
    logged = scalars(output_dir / "straight", "train/lr")
    schedule = trainer_schedule(RESUMED_SCHEDULE, TOTAL_UPDATES)
    assert logged == pytest.approx([schedule(update) for update in range(TOTAL_UPDATES)], rel=1e-6)
    assert logged[0] == 0.0 and max(logged) == pytest.approx(1e-4)  # a warm-up from 0 to the peak


@pytest.mark.multiprocess
def test_with_ema_the_validation_loss_is_that_of_the_exported_ema_weights(straight_and_resumed):
    output_dir, _, _ = straight_and_resumed
    run = output_dir / "straight"
    exported, raw = scalars(run, "val/loss"), scalars(run, "val/loss_raw")
    assert len(exported) == len(raw) == 3  # base model, after epoch 1 and at the end (update 14, in epoch 2)
    assert exported[0] == raw[0]  # before training the EMA is the base model
    assert exported[1:] != raw[1:]


@pytest.mark.multiprocess
def test_checkpoint_folder_holds_every_part_and_no_pickle(straight_and_resumed):
    output_dir, _, _ = straight_and_resumed
    checkpoint = output_dir / "straight" / "checkpoints" / checkpoint_name(5)
    names = {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()}
    assert {METADATA_FILE, TRAINER_STATE_FILE, "data_position.safetensors", "rng/rank0.safetensors", "rng/rank1.safetensors"} <= names
    assert ".metadata" not in names  # DCP's pickled index is replaced by JSON
    json.loads((checkpoint / METADATA_FILE).read_text())
    state = read_trainer_state(checkpoint)
    assert state.update == 5 and state.epoch == 0 and state.updates_in_epoch == 5
    assert state.optimizer == "adamw8bit" and state.use_ema and state.ema_updates == 5 and state.world_size == 2
    position = load_file(checkpoint / "data_position.safetensors")
    assert len(position["consumed"]) == 5 * 2  # 5 updates of a global batch of 2


@pytest.mark.multiprocess
def test_scheduled_saves_and_total_limit(straight_and_resumed):
    output_dir, _, _ = straight_and_resumed
    straight = [path.name for path in complete_checkpoints(output_dir / "straight" / "checkpoints")]
    total = read_trainer_state(output_dir / "straight" / "checkpoints" / straight[-1]).update
    assert total == 14
    assert straight == [checkpoint_name(update) for update in (5, 10, 14)]  # every 5 and at the end
    resumed = [path.name for path in complete_checkpoints(output_dir / "resumed" / "checkpoints")]
    assert resumed == straight[-2:]


# ---- resharding and a save killed halfway ------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory, tiny_pipeline_dir):
    """Checkpoints saved on 1 (a plain UNet) or 2 processes (FSDP2 shards), made once per module."""
    folders: dict[int, Path] = {}

    def saved(processes: int) -> Path:
        if processes not in folders:
            folders[processes] = tmp_path_factory.mktemp(f"saved_on_{processes}")
            run_processes(processes, WORKER, ["save", str(tiny_pipeline_dir), str(folders[processes]), ",".join(RESHARDED_OPTIMIZERS)])
        return folders[processes]

    return saved


# The optimizers whose state is not laid out as the weights and the EMA are, which every load compares:
# 8-bit AdamW's quantised blocks and Adafactor's and CAME's factored rows and columns. AdamW's two moments and
# Lion's momentum are DTensors shaped like their weight, so they reshard as the weights do (and save and
# restore on 2 processes in test_train_step_distributed.py).
RESHARDED_OPTIMIZERS = ("adamw8bit", "adafactor", "came")


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved_processes,processes", [(2, 1), (1, 2)])
def test_state_resumes_on_another_number_of_processes(saved_on, tiny_pipeline_dir, saved_processes, processes):
    """DCP reshards on load, between FSDP2 shards and the plain UNet one process trains. From shards to more
    shards (2-way to 4-way, the weights and 8-bit AdamW's state) is test_hsdp.py's resume as full sharding."""
    folder = saved_on(saved_processes)
    run_processes(processes, WORKER, ["load", str(tiny_pipeline_dir), str(folder), ",".join(RESHARDED_OPTIMIZERS)])
    report = json.loads((folder / f"load_on_{processes}.json").read_text())
    assert list(report) == list(RESHARDED_OPTIMIZERS)
    for name in RESHARDED_OPTIMIZERS:
        result = report[name]
        assert result["missing"] == []
        assert result["weights_max_difference"] == 0.0, f"{name}: weights changed on load"
        # torchao re-quantises 8-bit state whose shards change size (blocks of 256 values); the rest is exact.
        tolerance = 1e-5 if name == "adamw8bit" else 0.0
        assert result["state_max_difference"] <= tolerance, f"{name}: optimizer/EMA state differs by {result['state_max_difference']}"
        assert np.isfinite(result["next_loss"])


@pytest.mark.multiprocess
def test_a_save_killed_halfway_leaves_the_last_good_checkpoint(tmp_path, tiny_pipeline_dir):
    result = run_processes(2, WORKER, ["die_during_save", str(tiny_pipeline_dir), str(tmp_path), "adamw"], expect_success=False)
    assert result.returncode != 0
    assert (tmp_path / "adamw" / TRAINER_STATE_FILE).is_file()
    assert not (tmp_path / "adamw_update_2").exists()  # never renamed to its final name
    assert not (tmp_path / "adamw_update_2.tmp" / TRAINER_STATE_FILE).exists()
    # the good checkpoint resumes, on 2 processes, to exactly what was saved
    run_processes(2, WORKER, ["load", str(tiny_pipeline_dir), str(tmp_path), "adamw"])
    report = json.loads((tmp_path / "load_on_2.json").read_text())["adamw"]
    assert report["weights_max_difference"] == 0.0 and report["state_max_difference"] == 0.0


def test_latest_skips_incomplete_checkpoints_and_pruning_removes_dead_saves(tmp_path):
    for update, complete in [(3, True), (10, True), (12, False)]:
        folder = tmp_path / checkpoint_name(update)
        folder.mkdir()
        if complete:
            (folder / TRAINER_STATE_FILE).write_text("{}")
    (tmp_path / (checkpoint_name(14) + ".tmp")).mkdir()
    latest, skipped = find_latest_checkpoint(tmp_path)
    assert latest is None  # "{}" is no trainer state: both complete-looking folders are damaged, and said so
    assert sorted(path.name for path in skipped) == [checkpoint_name(3), checkpoint_name(10)]
    assert all("is damaged" in reason or "earlier version" in reason for reason in skipped.values())
    removed = remove_old_checkpoints(tmp_path, keep=1)
    assert [path.name for path in removed] == [checkpoint_name(14) + ".tmp"]  # damaged checkpoints are never the limit's to delete
    assert sorted(path.name for path in tmp_path.iterdir()) == [checkpoint_name(3), checkpoint_name(10), checkpoint_name(12)]
    assert find_latest_checkpoint(tmp_path / "missing") == (None, {})


def test_latest_without_a_checkpoint_says_why_it_starts_from_the_base_model(tmp_path):
    from sdxl_trainer.state.checkpointer import no_checkpoint_reason

    checkpoints = tmp_path / "checkpoints"
    assert no_checkpoint_reason(checkpoints) == "the folder does not exist"
    checkpoints.mkdir()
    assert no_checkpoint_reason(checkpoints) == "the folder is empty"
    (checkpoints / (checkpoint_name(4) + ".tmp")).mkdir()
    assert no_checkpoint_reason(checkpoints) == f"it holds only {checkpoint_name(4)}.tmp, a save that never finished"
    (checkpoints / f"abandoned_after_{checkpoint_name(2)}_20250101-120000").mkdir()
    assert no_checkpoint_reason(checkpoints) == (
        f"it holds only {checkpoint_name(4)}.tmp, a save that never finished, and abandoned_after_{checkpoint_name(2)}_20250101-120000, "
        "set aside by going back (name a checkpoint in it with --load_saved_state to continue that branch)"
    )


def test_overwrite_run_deletes_the_abandoned_branches_only_when_told(tmp_path):
    from sdxl_trainer.state.run_folder import start_over

    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    for name in (checkpoint_name(4), f"abandoned_after_{checkpoint_name(2)}_20250101-120000/{checkpoint_name(3)}"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / TRAINER_STATE_FILE).write_text("{}")
    (run / "pipeline_epoch_0001").mkdir()
    (run / "logs").mkdir()
    (run / "logs" / "events.out.tfevents.1.host.1.0").write_text("curve")
    messages = start_over(run, [run / "pipeline_epoch_0001", run / "logs" / "events.out.tfevents.1.host.1.0", run / "missing"], delete_abandoned=False)
    assert messages[0] == f"--overwrite_run: deleted the earlier run's checkpoints in {checkpoints}: {checkpoint_name(4)}."
    assert messages[1].startswith(f"--overwrite_run: kept abandoned_after_{checkpoint_name(2)}_20250101-120000 in {checkpoints}")
    assert "--delete_abandoned_branches" in messages[1]
    aside = next(run.glob("overwritten_*"))
    assert messages[2].startswith(f"--overwrite_run: moved the earlier run's exports and logs into {aside} (")
    assert messages[2].endswith("): pipeline_epoch_0001, logs/events.out.tfevents.1.host.1.0.")
    assert (aside / "pipeline_epoch_0001").is_dir() and (aside / "logs" / "events.out.tfevents.1.host.1.0").read_text() == "curve"
    assert sorted(path.name for path in checkpoints.iterdir()) == [f"abandoned_after_{checkpoint_name(2)}_20250101-120000"]

    messages = start_over(run, [], delete_abandoned=True)
    assert messages == [f"--overwrite_run: deleted the earlier run's checkpoints in {checkpoints}: abandoned_after_{checkpoint_name(2)}_20250101-120000."]
    assert list(checkpoints.iterdir()) == []
    assert start_over(tmp_path / "empty", [], delete_abandoned=True) == []


@pytest.mark.multiprocess
def test_a_resume_on_other_data_is_refused_unless_accepted_and_then_starts_its_epoch_over(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """Without validation loss no split file compares the data, and a resume on the cache's items in another order
    went on as if they were the same (its data position names items by their place). It is refused, naming the
    flag; with --accept_changed_dataset the run goes on from the checkpoint's update, its epoch started over."""
    import shutil

    import pyarrow.parquet as pq

    from sdxl_trainer.cache.format import MANIFEST_DIR

    reordered = tmp_path / "reordered_cache"
    shutil.copytree(sample_cache_dir, reordered)
    for part in sorted((reordered / MANIFEST_DIR).glob("*.parquet")):
        table = pq.read_table(part)
        pq.write_table(table.take(list(reversed(range(len(table))))).replace_schema_metadata(table.schema.metadata), part)
    common = ("--optimizer", "adamw", "--no-validation_loss")
    run_processes(1, TRAINER, trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "run", *common, "--max_train_updates", "2"))
    resumed = trainer_flags(reordered, tiny_pipeline_dir, tmp_path, "run", *common, "--max_train_updates", "3", "--load_saved_state", "latest")
    checkpoint = tmp_path / "run" / "checkpoints" / checkpoint_name(2)

    refused = run_processes(1, TRAINER, resumed, expect_success=False)
    assert refused.returncode == 1
    assert (f"Cannot start training: {checkpoint} was saved training on other data (the same 28 items, in another order (a cache's manifest "
            "was written anew))") in refused.stderr
    assert "pass --accept_changed_dataset to go on with these: epoch 1 then starts over on them" in refused.stderr
    accepted = run_processes(1, TRAINER, [*resumed, "--accept_changed_dataset"])
    assert (f"--accept_changed_dataset: the data changed since {checkpoint} (the same 28 items, in another order (a cache's manifest was "
            "written anew)), so epoch 1 starts over on it; the update count and the learning-rate schedule go on from update 2.") in accepted.stdout
    resumed_state = read_trainer_state(tmp_path / "run" / "checkpoints" / checkpoint_name(3))
    assert (resumed_state.update, resumed_state.epoch, resumed_state.updates_in_epoch) == (3, 0, 1)


# ---- signals -------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_sigterm_saves_state_and_exits_zero_then_latest_resumes(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    flags = trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "signalled", "--num_train_epochs", "20", "--optimizer", "adamw",
                          "--save_state_every_n_updates", "2", "--load_saved_state", "latest", "--save_diffusers")
    checkpoints = tmp_path / "signalled" / "checkpoints"

    def stop_one_rank_after_the_first_save(ranks: list[multiprocessing.process.BaseProcess]) -> None:
        deadline = time.monotonic() + 300
        while find_latest_checkpoint(checkpoints)[0] is None and time.monotonic() < deadline and all(rank.exitcode is None for rank in ranks):
            time.sleep(0.5)
        assert find_latest_checkpoint(checkpoints)[0] is not None, "training never saved its first checkpoint"
        os.kill(ranks[-1].pid, signal.SIGTERM)  # one rank only: the ranks must agree to stop together

    stopped = run_processes(2, TRAINER, flags, while_running=stop_one_rank_after_the_first_save)
    stopped_at = int(stopped.stdout.split("Stopped on request after update ")[1].split(".")[0])
    assert stopped_at >= 2
    assert find_latest_checkpoint(checkpoints)[0].name == checkpoint_name(stopped_at)
    assert not (tmp_path / "signalled" / "pipeline").exists()
    # The same command (capped one update later, to finish quickly) picks the newest complete checkpoint and says so.
    resumed = run_processes(2, TRAINER, [*flags, "--max_train_updates", str(stopped_at + 1)])
    assert f"Resumed from {checkpoints / checkpoint_name(stopped_at)}" in resumed.stdout
    assert (tmp_path / "signalled" / UNET_FILE).is_file()


@pytest.mark.multiprocess
def test_ctrl_c_during_start_up_ends_it_in_one_line_and_leaves_the_run_folder_free(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """Ctrl-C reaches every rank (the terminal's process group) while the run is still starting: nothing was
    trained, so the ranks stop where they are, one line says so, and no checkpoint or lock is left behind."""
    run_dir = tmp_path / "interrupted"
    flags = trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "interrupted", "--save_state_every_n_updates", "1")

    def interrupt_every_rank_once_the_run_folder_is_held(ranks: list[multiprocessing.process.BaseProcess]) -> None:
        deadline = time.monotonic() + 120
        while not (run_dir / RUN_LOCK_FILE).exists() and time.monotonic() < deadline and all(rank.exitcode is None for rank in ranks):
            time.sleep(0.05)
        assert (run_dir / RUN_LOCK_FILE).exists(), "the run never took its folder"
        for rank in ranks:
            os.kill(rank.pid, signal.SIGINT)

    stopped = run_processes(2, TRAINER, flags, expect_success=False, while_running=interrupt_every_rank_once_the_run_folder_is_held)
    line = "SIGINT received during start-up, before the first update: stopped there (nothing was trained yet, so there was nothing to save)."
    assert stopped.returncode == 1 and stopped.stderr.count(line) == 1, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert find_latest_checkpoint(run_dir / "checkpoints")[0] is None
    RunFolderLock(run_dir).release()  # free: a new run may start


# ---- data position -------------------------------------------------------------------------------------


def test_rest_of_epoch_is_the_original_plan_or_a_replan_of_untrained_items():
    bucket_ids = np.repeat([1, 2, 3], [9, 7, 6])
    items = np.arange(len(bucket_ids))
    planner = EpochPlanner(bucket_ids, items, global_batch_size=2, accumulation_steps=1, seed=4)
    straight = planner.plans(3)
    consumed = np.concatenate(straight[1].batches[:3])
    resumed = planner.plans(3, start_epoch=1, carried_in=straight[0].carried_out, consumed=consumed)
    assert all(np.array_equal(a, b) for a, b in zip(resumed[0].batches, straight[1].batches[3:]))
    assert np.array_equal(resumed[0].carried_out, straight[1].carried_out)
    assert all(np.array_equal(a, b) for a, b in zip(resumed[1].batches, straight[2].batches))
    # another global batch (more processes): the untrained items of the epoch are planned anew, none twice
    regrouped = EpochPlanner(bucket_ids, items, global_batch_size=3, accumulation_steps=1, seed=4)
    rest = regrouped.plans(3, start_epoch=1, carried_in=straight[0].carried_out, consumed=consumed)[0]
    trained_rest = np.concatenate(rest.batches)
    assert not set(trained_rest) & set(consumed)
    assert set(trained_rest) | set(rest.carried_out) | set(consumed) == set(items)


# ---- single-file export and import ---------------------------------------------------------------------


def test_single_file_round_trip_through_diffusers_loader(tmp_path, tiny_pipeline_dir):
    from diffusers import StableDiffusionXLPipeline

    import sdxl_to_single_file
    from sdxl_trainer.models.single_file import load_pipeline

    single_file = tmp_path / "tiny.safetensors"
    assert sdxl_to_single_file.main(["--pipeline", str(tiny_pipeline_dir), "--output", str(single_file), "--save_precision", "fp32"]) == 0
    keys = load_file(single_file).keys()
    assert any(key.startswith("model.diffusion_model.input_blocks.") for key in keys)
    assert any(key.startswith("conditioner.embedders.1.model.transformer.resblocks.") for key in keys)
    assert any(key.startswith("first_stage_model.decoder.up.") for key in keys)
    original = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_dir)
    loaded = load_pipeline(str(single_file), str(tiny_pipeline_dir), torch.float32)
    for component in ("unet", "vae", "text_encoder", "text_encoder_2"):
        expected, actual = getattr(original, component).state_dict(), getattr(loaded, component).state_dict()
        assert expected.keys() == actual.keys()
        for name, tensor in expected.items():
            assert torch.equal(tensor, actual[name]), f"{component}.{name} changed in the round trip"


def test_single_file_carries_the_objective_markers_and_model_spec(tmp_path, tiny_pipeline_dir):
    """ComfyUI and A1111/Forge tell a v-prediction (and zero-terminal-SNR) SDXL file by its `v_pred` and
    `ztsnr` keys; without them such a fine-tune is sampled as epsilon."""
    import math
    import shutil

    from safetensors import safe_open

    import sdxl_to_single_file

    v_pipeline = tmp_path / "v_pipeline"
    shutil.copytree(tiny_pipeline_dir, v_pipeline)
    scheduler_file = v_pipeline / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_file.read_text())
    scheduler.update(prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing")
    scheduler_file.write_text(json.dumps(scheduler))
    for pipeline, name in ((tiny_pipeline_dir, "epsilon.safetensors"), (v_pipeline, "v.safetensors")):
        assert sdxl_to_single_file.main(["--pipeline", str(pipeline), "--output", str(tmp_path / name), "--save_precision", "fp32"]) == 0
    with safe_open(str(tmp_path / "v.safetensors"), framework="pt") as handle:
        metadata, keys = handle.metadata(), set(handle.keys())
        position_ids = handle.get_tensor("conditioner.embedders.0.transformer.text_model.embeddings.position_ids")
        logit_scale = handle.get_tensor("conditioner.embedders.1.model.logit_scale")
    assert {"v_pred", "ztsnr"} <= keys
    assert metadata["modelspec.prediction_type"] == "v" and metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert metadata["modelspec.title"] == "v" and metadata["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert metadata["modelspec.resolution"].count("x") == 1 and len(metadata["modelspec.date"]) == 10
    assert position_ids.dtype == torch.int64 and position_ids.tolist() == [list(range(position_ids.shape[1]))]
    assert logit_scale.item() == pytest.approx(math.log(100))
    with safe_open(str(tmp_path / "epsilon.safetensors"), framework="pt") as handle:
        assert not {"v_pred", "ztsnr"} & set(handle.keys()) and handle.metadata()["modelspec.prediction_type"] == "epsilon"


@pytest.mark.multiprocess
def test_trains_from_a_single_file_base_and_exports_one(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """The exported files are named after the run in their metadata (`modelspec.title`, shown by UIs and
    model hubs), not after the file ("pipeline")."""
    from safetensors import safe_open

    import sdxl_to_single_file

    base_file = tmp_path / "base.safetensors"
    sdxl_to_single_file.main(["--pipeline", str(tiny_pipeline_dir), "--output", str(base_file), "--save_precision", "fp32"])
    flags = trainer_flags(sample_cache_dir, base_file, tmp_path, "from_file", "--num_train_epochs", "2", "--save_model_every_n_epochs", "1",
                          "--optimizer", "adamw", "--single_file_config", str(tiny_pipeline_dir), "--save_single_file", "--save_diffusers", "--no-save_state")
    run_processes(1, TRAINER, flags)
    for file, title in (("pipeline.safetensors", "from_file"), ("pipeline_epoch_0001.safetensors", "from_file_epoch_0001")):
        with safe_open(str(tmp_path / "from_file" / file), framework="pt") as handle:
            assert handle.metadata()["modelspec.title"] == title
    exported = load_file(tmp_path / "from_file" / "pipeline.safetensors")
    trained_unet = load_file(tmp_path / "from_file" / UNET_FILE)
    base_unet = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    from sdxl_trainer.models.single_file import unet_to_ldm

    config = json.loads((tiny_pipeline_dir / "unet" / "config.json").read_text())
    for key, tensor in unet_to_ldm(trained_unet, config).items():
        assert torch.equal(exported[key], tensor)
    assert any(not torch.equal(trained_unet[name], base_unet[name]) for name in base_unet)
    assert not (tmp_path / "from_file" / "checkpoints").exists()


@pytest.mark.multiprocess
def test_the_vae_a_cache_was_encoded_with_is_the_one_exported(tmp_path, tiny_pipeline_dir):
    """Caching with --vae_name_or_path (README's fp16-fix example) used to export the base model's VAE,
    which decodes those latents differently."""
    from sdxl_trainer.models.tiny import save_tiny_pipeline

    other_vae = save_tiny_pipeline(tmp_path / "other", seed=1) / "vae"
    cache_dir = tmp_path / "cache"
    assert process_data_dir(
        ["--data_dir", str(REPO_ROOT / "sample_dataset"), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--vae_name_or_path", str(other_vae), *SAMPLE_RESOLUTION_FLAGS]
    ) == 0
    run_processes(1, TRAINER, trainer_flags(cache_dir, tiny_pipeline_dir, tmp_path, "other_vae", "--num_train_epochs", "1", "--optimizer", "adamw",
                                            "--no-save_state", "--no-validation_loss", "--save_diffusers"))
    exported = load_file(tmp_path / "other_vae" / "pipeline" / "vae" / "diffusion_pytorch_model.safetensors")
    cached_with = load_file(other_vae / "diffusion_pytorch_model.safetensors")
    base = load_file(tiny_pipeline_dir / "vae" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported[name], cached_with[name]) for name in cached_with)
    assert any(not torch.equal(exported[name], base[name]) for name in base)


# ---- pipeline handoff ----------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_every_process_gets_the_trained_weights_through_the_handoff_folder(tmp_path, tiny_pipeline_dir):
    run_processes(2, WORKER, ["handoff", str(tiny_pipeline_dir), str(tmp_path), "adamw"])
    reports = [json.loads((tmp_path / f"handoff_rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0]["folder"] == reports[1]["folder"] and reports[0]["folder"].startswith(str(tmp_path))
    for report in reports:
        assert report["max_difference"] == 0.0
        assert report["trained_vs_base"] > 0
        assert report["folder_removed"] and report["removed_after_error"]
    assert not list(tmp_path.glob("sdxl_handoff_*"))
