"""The trainer under the faults real machines produce: a checkpoint with a planted pickle or damaged files, an
error in one rank, a killed launcher, a full disk, bad flags. Each ends in bounded time with a message that
names the file or flag, and never loses what was already saved. Distributed parts run on 2 CPU processes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing.process
import os
import pickle
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import (
    REPO_ROOT,
    SAMPLE_RESOLUTION_FLAGS,
    launcher_command,
    process_data_dir,
    process_env,
    run_processes,
    scalars,
    small_filesystem_prefix,
    trainer_flags,
)

from sdxl_trainer.config import parse_config
from sdxl_trainer.state.checkpoint_layout import CHECKSUMS_FILE, METADATA_FILE, TRAINER_STATE_FILE, CheckpointError
from sdxl_trainer.state.checkpoints_folder import checkpoint_name, complete_checkpoints, find_latest_checkpoint
from sdxl_trainer.state.dcp_json_index import JsonIndexReader
from sdxl_trainer.state.verify import checkpoint_problem

TRAINER = REPO_ROOT / "sdxl_FSDP_train.py"
QUICK = ("--optimizer", "adamw", "--no-validation_loss", "--num_train_epochs", "1")


def train_flags(cache_dir: Path, pipeline_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    return trainer_flags(cache_dir, pipeline_dir, output_dir, "run", *QUICK, *extra)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir) -> Path:
    """A finished 2-process run of 12 updates with checkpoints after updates 4, 8 and 12."""
    output_dir = tmp_path_factory.mktemp("saved_run")
    run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, output_dir, "--save_state_every_n_updates", "4", "--checkpoints_total_limit", "0",
                                          "--max_train_updates", "12"))
    return output_dir / "run"


def copy_of(run: Path, destination: Path) -> Path:
    shutil.copytree(run, destination / "run", ignore=shutil.ignore_patterns("tensorboard"))
    return destination / "run"


# ---- nothing in a checkpoint runs code ----------------------------------------------------------------


class OpensAFile:
    """Unpickling this creates the file: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant_pickle(checkpoint: Path, marker: Path) -> None:
    """What a malicious shared checkpoint would do: point an entry DCP reads as bytes (so with
    torch.load(weights_only=False)) at a pickle that runs code."""
    payload = pickle.dumps(OpensAFile(marker))
    shard = checkpoint / "__0_0.distcp"
    start = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(payload)
    index = json.loads((checkpoint / METADATA_FILE).read_text())
    fqn = "optimizer.param_groups.0.lr"
    index["state_dict_metadata"][fqn] = {"bytes": True}
    index["storage_data"] = [item for item in index["storage_data"] if item["fqn"] != fqn]
    index["storage_data"].append({"fqn": fqn, "offset": None, "index": None, "path": "__0_0.distcp", "start": start, "length": len(payload), "transforms": None})
    (checkpoint / METADATA_FILE).write_text(json.dumps(index))


@pytest.mark.multiprocess
def test_every_entry_of_a_checkpoint_is_a_tensor(saved_run):
    for checkpoint in (saved_run / "checkpoints").iterdir():
        entries = json.loads((checkpoint / METADATA_FILE).read_text())["state_dict_metadata"]
        assert entries and all("dtype" in entry for entry in entries.values()), checkpoint
        assert not any(".param_groups." in name for name in entries)  # hyperparameters come from the flags


@pytest.mark.multiprocess
def test_every_file_of_a_checkpoint_has_its_checksum_recorded(saved_run):
    import hashlib

    for checkpoint in (saved_run / "checkpoints").iterdir():
        recorded = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
        files = {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()}
        assert set(recorded["files"]) == files - {CHECKSUMS_FILE}  # trainer_state.json included: its counters and format marker
        assert {"__0_0.distcp", "__1_0.distcp", "rng/rank1.safetensors", METADATA_FILE} <= set(recorded["files"])
        for name, digest in recorded["files"].items():
            assert hashlib.new(recorded["algorithm"], (checkpoint / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.multiprocess
def test_a_planted_pickle_never_runs_and_the_load_fails_naming_the_file(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    run = copy_of(saved_run, tmp_path)
    planted = run / "checkpoints" / checkpoint_name(12)
    marker = tmp_path / "code_ran"
    plant_pickle(planted, marker)
    with pytest.raises(CheckpointError, match="is not a tensor .reading it would mean unpickling it, which can run code") as refused:
        JsonIndexReader(planted).read_metadata()
    assert str(planted / METADATA_FILE) in str(refused.value)

    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", str(planted)), expect_success=False)
    assert result.returncode != 0
    assert "Cannot start training" in result.stderr and f"{planted / METADATA_FILE} is refused" in result.stderr
    assert result.stderr.count("is refused") == 1  # printed once, by one rank
    assert not marker.exists(), "code planted in the checkpoint ran"


def rewrite_trainer_state(checkpoint: Path, text: str) -> None:
    """An edit of trainer_state.json that also records its new checksum, so the checks under the checksum (JSON,
    fields, format) are what finds it."""
    (checkpoint / TRAINER_STATE_FILE).write_text(text)
    checksums = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
    if TRAINER_STATE_FILE in checksums["files"]:
        checksums["files"][TRAINER_STATE_FILE] = hashlib.sha256(text.encode()).hexdigest()
        (checkpoint / CHECKSUMS_FILE).write_text(json.dumps(checksums))


def flip_in_trainer_state(checkpoint: Path, field: str, new_value: int) -> Path:
    """What a flipped bit does to trainer_state.json: one field's digits change in place, nothing else."""
    state_file = checkpoint / TRAINER_STATE_FILE
    text = state_file.read_text()
    old = f'"{field}": {json.loads(text)[field]}'
    assert text.count(old) == 1
    state_file.write_text(text.replace(old, f'"{field}": {new_value}'))
    return state_file


def damage(checkpoint: Path, kind: str) -> str:
    """Damage the checkpoint in one way; returns a piece of the message that must name it."""
    index_file = checkpoint / METADATA_FILE
    if kind == "truncated shard":
        shard = checkpoint / "__1_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
        return f"{shard} is truncated"
    if kind == "missing shard":
        (checkpoint / "__0_0.distcp").unlink()
        return f"{checkpoint / '__0_0.distcp'} is missing"
    if kind == "index not JSON":
        index_file.write_text(index_file.read_text()[:1000])
        return f"{index_file} is damaged"
    if kind == "unknown dtype":
        index = json.loads(index_file.read_text())
        next(iter(index["state_dict_metadata"].values()))["dtype"] = "load"
        index_file.write_text(json.dumps(index))
        return "has the unknown dtype 'load'"
    if kind == "file outside the checkpoint":
        index = json.loads(index_file.read_text())
        index["storage_data"][0]["path"] = "../../../etc/passwd"
        index_file.write_text(json.dumps(index))
        return "points at '../../../etc/passwd', not a shard file of this checkpoint"
    if kind == "trainer state not JSON":
        rewrite_trainer_state(checkpoint, '{"update": 1')
        return f"{checkpoint / TRAINER_STATE_FILE} is damaged (not JSON"
    if kind == "trainer state field missing":
        state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
        del state["seed"]
        rewrite_trainer_state(checkpoint, json.dumps(state))
        return "fields missing: ['seed']"
    if kind == "trainer state bit flipped":
        return f"{flip_in_trainer_state(checkpoint, 'update', 14)} does not match its checksum"
    if kind == "rng state damaged":
        (checkpoint / "rng" / "rank1.safetensors").write_bytes(b"\x00" * 20)
        return f"{checkpoint / 'rng' / 'rank1.safetensors'} is missing or damaged"
    if kind == "checksums missing":
        (checkpoint / CHECKSUMS_FILE).unlink()
        return f"{checkpoint / CHECKSUMS_FILE} is missing or damaged"
    if kind == "shard without a checksum":
        checksums = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
        del checksums["files"]["__1_0.distcp"]
        (checkpoint / CHECKSUMS_FILE).write_text(json.dumps(checksums))
        return f"{checkpoint / CHECKSUMS_FILE} lists no checksum for __1_0.distcp"
    if kind == "earlier version":
        state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
        del state["format_version"]
        rewrite_trainer_state(checkpoint, json.dumps(state))
        return "was written by an earlier version of this trainer"
    raise ValueError(kind)


DAMAGE_KINDS = ["truncated shard", "missing shard", "index not JSON", "unknown dtype", "file outside the checkpoint",
                "trainer state not JSON", "trainer state field missing", "trainer state bit flipped", "rng state damaged", "earlier version",
                "checksums missing", "shard without a checksum"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_damaged_checkpoints_are_named(tmp_path, saved_run, kind):
    checkpoint = copy_of(saved_run, tmp_path) / "checkpoints" / checkpoint_name(12)
    assert checkpoint_problem(checkpoint) is None
    expected = damage(checkpoint, kind)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and expected in problem, problem


@pytest.mark.multiprocess
@pytest.mark.parametrize("field,flipped", [("update", 14), ("format_version", 2)])
def test_a_flipped_bit_in_trainer_state_json_is_found_naming_the_file(tmp_path, saved_run, field, flipped):
    """trainer_state.json was the one file checksums.json left out: "update": 12 -> 14 resumed at the wrong schedule
    and data position, and "format_version" -> 2 switched the checksums off (zeroed weights were accepted then)."""
    checkpoint = copy_of(saved_run, tmp_path) / "checkpoints" / checkpoint_name(12)
    state_file = flip_in_trainer_state(checkpoint, field, flipped)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and f"{state_file} does not match its checksum" in problem, problem


@pytest.mark.multiprocess
def test_checksums_json_not_a_field_decides_that_checksums_are_checked(tmp_path, saved_run):
    """A checkpoint saved before trainer_state.json was checksummed (format 3: checksums.json lists every other
    file) still resumes; its format marker flipped to 2 (before checksums) contradicts the checksums.json
    beside it and is refused, instead of switching the checksums off."""
    checkpoint = copy_of(saved_run, tmp_path) / "checkpoints" / checkpoint_name(12)
    checksums = json.loads((checkpoint / CHECKSUMS_FILE).read_text())
    checksums["files"].pop(TRAINER_STATE_FILE, None)
    (checkpoint / CHECKSUMS_FILE).write_text(json.dumps(checksums))
    state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
    (checkpoint / TRAINER_STATE_FILE).write_text(json.dumps({**state, "format_version": 3}, indent=2))
    assert checkpoint_problem(checkpoint) is None
    state_file = flip_in_trainer_state(checkpoint, "format_version", 2)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and str(state_file) in problem and str(checkpoint / CHECKSUMS_FILE) in problem, problem


@pytest.mark.multiprocess
def test_latest_with_every_checkpoint_damaged_refuses_to_start_naming_each_and_the_fix(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    """It used to say "No complete checkpoint ... yet: starting from the base model", and with
    --checkpoints_total_limit 2 each of its own saves was deleted right after it was written (the damaged
    checkpoints had higher update numbers), so a requeued job started over every time."""
    run = copy_of(saved_run, tmp_path)
    checkpoints = run / "checkpoints"
    flipped_update = flip_in_trainer_state(checkpoints / checkpoint_name(12), "update", 14)
    flipped_format = flip_in_trainer_state(checkpoints / checkpoint_name(8), "format_version", 2)
    zero_inside_the_largest_record(checkpoints / checkpoint_name(8))  # found too when the format flip switched checksums off
    zeroed_shard = zero_inside_the_largest_record(checkpoints / checkpoint_name(4))
    flags = train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest", "--checkpoints_total_limit", "2")
    result = run_processes(1, TRAINER, flags, expect_success=False, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert f"--load_saved_state latest: every checkpoint in {checkpoints} is damaged" in result.stderr, result.stderr[-3000:]
    for damaged_file in (flipped_update, flipped_format, zeroed_shard):
        assert result.stderr.count(f"{damaged_file} does not match its checksum") == 1, result.stderr[-3000:]
    assert "--load_saved_state PATH" in result.stderr and "--overwrite_run" in result.stderr
    assert "starting from the base model" not in output and "Skipping damaged checkpoint" not in output
    assert sorted(path.name for path in checkpoints.iterdir()) == [checkpoint_name(update) for update in (4, 8, 12)]  # nothing deleted or added


@pytest.mark.multiprocess
def test_damaged_checkpoints_never_count_toward_the_limit_nor_are_deleted_by_it(tmp_path, saved_run):
    """The limit keeps the newest intact-looking checkpoints of this run: damaged 10 and 12 once outranked every
    new save, which was deleted right after it was written."""
    from sdxl_trainer.state.checkpoints_folder import remove_old_checkpoints

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for update, source in ((1, 4), (2, 8), (3, 12), (10, 8), (12, 12)):
        shutil.copytree(saved_run / "checkpoints" / checkpoint_name(source), checkpoints / checkpoint_name(update))
    damage(checkpoints / checkpoint_name(10), "truncated shard")
    damage(checkpoints / checkpoint_name(12), "trainer state not JSON")
    removed = remove_old_checkpoints(checkpoints, 2)
    assert [path.name for path in removed] == [checkpoint_name(1)]
    assert [path.name for path in complete_checkpoints(checkpoints)] == [checkpoint_name(update) for update in (2, 3, 10, 12)]
    # A checkpoint of a higher update that looks intact is no part of the run that saved update 3: not counted either.
    shutil.copytree(saved_run / "checkpoints" / checkpoint_name(4), checkpoints / checkpoint_name(20))
    assert remove_old_checkpoints(checkpoints, 1, saved=checkpoints / checkpoint_name(3)) == [checkpoints / checkpoint_name(2)]
    assert [path.name for path in complete_checkpoints(checkpoints)] == [checkpoint_name(update) for update in (3, 10, 12, 20)]


@pytest.mark.multiprocess
def test_latest_skips_damaged_checkpoints_says_so_and_resumes_from_the_newest_intact_one(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    run = copy_of(saved_run, tmp_path)
    marker = tmp_path / "code_ran"
    plant_pickle(run / "checkpoints" / checkpoint_name(12), marker)
    damage(run / "checkpoints" / checkpoint_name(8), "truncated shard")
    assert find_latest_checkpoint(run / "checkpoints")[0] == run / "checkpoints" / checkpoint_name(4)
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest", "--max_train_updates", "12"))
    assert f"Skipping damaged checkpoint {run / 'checkpoints' / checkpoint_name(12)}" in result.stdout
    assert f"Skipping damaged checkpoint {run / 'checkpoints' / checkpoint_name(8)}" in result.stdout
    assert f"Resumed from {run / 'checkpoints' / checkpoint_name(4)}" in result.stdout
    assert scalars(run, "train/loss") == scalars(saved_run, "train/loss")[4:]  # the run went on from update 4
    assert not marker.exists()


@pytest.mark.multiprocess
def test_a_resume_whose_global_batch_no_bucket_fills_stops_before_the_model_loads_naming_the_flags_and_buckets(
    tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir
):
    """Resuming mid-epoch with a global batch larger than every bucket once ended in a raw ValueError of the
    epoch planner, after the model had loaded. The copied pipeline has no UNet weights: loading it would fail."""
    run = copy_of(saved_run, tmp_path)
    no_unet = tmp_path / "no_unet"
    shutil.copytree(tiny_pipeline_dir, no_unet)
    for weights in (no_unet / "unet").glob("*.safetensors"):
        weights.unlink()
    flags = train_flags(sample_cache_dir, no_unet, tmp_path, "--load_saved_state", str(run / "checkpoints" / checkpoint_name(4)), "--train_batch_size", "64")
    result = run_processes(1, TRAINER, flags, expect_success=False, timeout=300)
    assert result.returncode == 1
    assert "Cannot start training: no bucket holds one global batch of --train_batch_size 64 x 1 process = 64 items" in result.stderr
    assert "lower --train_batch_size or run on fewer processes" in result.stderr
    manifest = pq.read_table(sample_cache_dir / "manifest").to_pylist()
    for width, height in {(row["bucket_width"], row["bucket_height"]) for row in manifest}:
        assert f"{width}x{height}" in result.stderr
    assert "Traceback" not in result.stderr


def zero_inside_the_largest_record(checkpoint: Path) -> Path:
    """What a failing disk or a bad copy does: 4 KiB in the middle of a weight's record become zeros, the
    file keeps its size and every header stays readable. Returns the damaged shard."""
    records = json.loads((checkpoint / METADATA_FILE).read_text())["storage_data"]
    largest = max(records, key=lambda record: record["length"])
    assert largest["length"] > 3 * 4096
    shard = checkpoint / largest["path"]
    with open(shard, "r+b") as handle:
        handle.seek(largest["start"] + largest["length"] // 2)
        handle.write(bytes(4096))
    return shard


def without_checksums(checkpoint: Path) -> None:
    """Make the checkpoint look like one saved before checksums were recorded (format 2)."""
    (checkpoint / CHECKSUMS_FILE).unlink()
    state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
    state["format_version"] = 2
    (checkpoint / TRAINER_STATE_FILE).write_text(json.dumps(state))


@pytest.mark.multiprocess
def test_latest_skips_a_checkpoint_whose_shard_changed_naming_the_file(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    run = copy_of(saved_run, tmp_path)
    shard = zero_inside_the_largest_record(run / "checkpoints" / checkpoint_name(12))
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest"))
    assert f"Skipping damaged checkpoint {run / 'checkpoints' / checkpoint_name(12)}: {shard} does not match its checksum" in result.stdout
    assert f"Resumed from {run / 'checkpoints' / checkpoint_name(8)}" in result.stdout
    assert "Verified the checksums of" in result.stdout


@pytest.mark.multiprocess
def test_a_named_checkpoint_whose_shard_changed_is_refused_naming_the_file(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    run = copy_of(saved_run, tmp_path)
    checkpoint = run / "checkpoints" / checkpoint_name(12)
    shard = zero_inside_the_largest_record(checkpoint)
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", str(checkpoint)), expect_success=False)
    assert result.returncode == 1
    assert "Cannot start training" in result.stderr and f"{shard} does not match its checksum" in result.stderr
    assert result.stderr.count("does not match its checksum") == 1  # printed once, by one rank


@pytest.mark.multiprocess
def test_a_checkpoint_saved_before_checksums_resumes_and_says_it_carries_none(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    run = copy_of(saved_run, tmp_path)
    for checkpoint in (run / "checkpoints").iterdir():
        without_checksums(checkpoint)
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest"))
    assert f"{run / 'checkpoints' / checkpoint_name(12)} carries no checksums" in result.stdout
    assert f"Resumed from {run / 'checkpoints' / checkpoint_name(12)}" in result.stdout


@pytest.mark.multiprocess
def test_an_unreadable_record_of_a_checkpoint_without_checksums_is_refused_naming_the_file(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    """Without checksums, only DCP's reading finds damage in a shard: its error must name the file."""
    run = copy_of(saved_run, tmp_path)
    checkpoint = run / "checkpoints" / checkpoint_name(12)
    without_checksums(checkpoint)
    record = json.loads((checkpoint / METADATA_FILE).read_text())["storage_data"][0]
    shard = checkpoint / record["path"]
    with open(shard, "r+b") as handle:  # the record's zip header
        handle.seek(record["start"])
        handle.write(bytes(64))
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", str(checkpoint)), expect_success=False)
    assert result.returncode == 1
    assert f"Cannot resume from {checkpoint}" in result.stderr and f"{shard} could not be read" in result.stderr, result.stderr[-3000:]


# ---- the run folder: one run at a time, no silent start over a finished run, going back -----------------


@pytest.mark.multiprocess
def test_a_second_run_into_the_same_folder_is_refused_on_every_rank_naming_the_first(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    flags = train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest")
    log = tmp_path / "run" / "train.log"

    def start_a_second_run_while_the_first_trains(first: list[multiprocessing.process.BaseProcess]) -> None:
        deadline = time.monotonic() + 240
        while not (log.is_file() and "First update done" in log.read_text()) and time.monotonic() < deadline and all(rank.exitcode is None for rank in first):
            time.sleep(0.5)
        assert log.is_file() and "First update done" in log.read_text(), "the first run never got going"
        try:
            second = run_processes(2, TRAINER, flags, expect_success=False, timeout=300)
            output = second.stdout + second.stderr
            assert second.returncode == 1, output[-3000:]
            assert output.count(f"{tmp_path / 'run'} is in use by another run") == 1, output[-3000:]
            assert any(f"(process {rank.pid} on {socket.gethostname()}" in output for rank in first), output[-3000:]
            assert all(rank.exitcode is None for rank in first)  # the first run trains on
        finally:
            for rank in first:
                os.kill(rank.pid, signal.SIGTERM)  # it saves and ends

    first = run_processes(2, TRAINER, [*flags, "--num_train_epochs", "50"], while_running=start_a_second_run_while_the_first_trains)
    assert "Stopped on request after update" in first.stdout


def leave_earlier_results(run: Path, saved_run: Path) -> dict[str, Path]:
    """What an earlier run leaves in its folder besides its checkpoints: an epoch export, the final export, its
    TensorBoard events, its sample grid and W&B run id. Returns them by name."""
    results = {"epoch export": run / "pipeline_epoch_0001", "export": run / "pipeline", "samples": run / "samples", "wandb id": run / "wandb_run_id.txt"}
    for name in ("epoch export", "export", "samples"):
        results[name].mkdir(parents=True, exist_ok=True)
        (results[name] / "marker").write_text(name)
    results["wandb id"].write_text("earlier0run\n")
    shutil.copytree(saved_run / "tensorboard", run / "tensorboard", dirs_exist_ok=True)
    results["events"] = run / "tensorboard"
    return results


@pytest.mark.multiprocess
def test_a_fresh_start_in_a_finished_runs_folder_is_refused_and_overwrite_run_starts_over(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    """--overwrite_run names every checkpoint it deletes, keeps the branches going back set aside (it promised
    "Nothing was deleted"), and moves the earlier run's exports, events, sample grid and W&B id aside into one
    named folder, so the run folder never shows two runs' curves and exports."""
    run = copy_of(saved_run, tmp_path)
    results = leave_earlier_results(run, saved_run)
    abandoned = run / "checkpoints" / f"abandoned_after_{checkpoint_name(4)}_20250101-120000"
    shutil.copytree(run / "checkpoints" / checkpoint_name(8), abandoned / checkpoint_name(8))
    (run / "checkpoints" / (checkpoint_name(14) + ".tmp")).mkdir()  # a save that died
    refused = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path), expect_success=False)
    assert refused.returncode == 1
    earlier = ", ".join(f"checkpoints/{checkpoint_name(update)}" for update in (4, 8, 12))
    message = f"{run} holds an earlier run ({earlier}, pipeline and 1 more)"
    assert refused.stderr.count(message) == 1, refused.stderr[-3000:]
    assert "continue it with --load_saved_state latest, start a new run with another --project_name, or start over in this folder with --overwrite_run" in refused.stderr
    assert [path.name for path in complete_checkpoints(run / "checkpoints")] == [checkpoint_name(update) for update in (4, 8, 12)]

    from sdxl_trainer.state.run_folder import earlier_run_problems

    (tmp_path / "exported_only" / "pipeline").mkdir(parents=True)
    assert "holds an earlier run (pipeline)" in earlier_run_problems(tmp_path / "exported_only")[0]

    started_over = run_processes(1, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--overwrite_run", "--max_train_updates", "2"))
    deleted = ", ".join(name for name in (*(checkpoint_name(update) for update in (4, 8, 12)), checkpoint_name(14) + ".tmp"))
    assert f"--overwrite_run: deleted the earlier run's checkpoints in {run / 'checkpoints'}: {deleted}." in started_over.stdout, started_over.stdout[-3000:]
    assert f"kept {abandoned.name} in {run / 'checkpoints'}" in started_over.stdout
    assert checkpoint_problem(abandoned / checkpoint_name(8)) is None  # kept whole
    aside = [path for path in run.iterdir() if path.name.startswith("overwritten_")]
    assert len(aside) == 1, sorted(path.name for path in run.iterdir())
    assert f"moved the earlier run's exports and logs into {aside[0]}" in started_over.stdout
    for name in ("epoch export", "export", "samples"):
        assert (aside[0] / results[name].name / "marker").read_text() == name
    assert (aside[0] / "wandb_run_id.txt").read_text() == "earlier0run\n"
    assert [path.name for path in (aside[0] / "tensorboard").iterdir()] == [path.name for path in (saved_run / "tensorboard").iterdir()]
    assert not results["epoch export"].exists() and not (results["samples"] / "marker").exists() and not results["wandb id"].exists()
    assert len(scalars(run, "train/loss")) == 2  # the new run's curve alone
    assert [path.name for path in complete_checkpoints(run / "checkpoints")] == [checkpoint_name(2)]


@pytest.mark.multiprocess
def test_latest_in_a_folder_with_an_exported_model_but_no_checkpoint_is_refused(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """A finished --no-save_state run relaunched with README's restart command used to start from the base model
    and replace its exported pipeline. In a folder with nothing in it, 'latest' starts from the base model and
    says why."""
    exported = tmp_path / "run" / "pipeline"
    exported.mkdir(parents=True)
    (exported / "marker").write_text("the earlier run's model")
    flags = train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", "latest")
    refused = run_processes(1, TRAINER, flags, expect_success=False, timeout=300)
    assert refused.returncode == 1, (refused.stdout + refused.stderr)[-3000:]
    assert refused.stderr.count(f"{tmp_path / 'run'} holds an earlier run (pipeline) but no checkpoint to continue it") == 1, refused.stderr[-3000:]
    assert "give this run another --project_name, or start over in this folder with --overwrite_run" in refused.stderr
    assert "starting from the base model" not in refused.stdout
    assert (exported / "marker").read_text() == "the earlier run's model"

    first_start = run_processes(1, TRAINER, trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "new", *QUICK, "--load_saved_state", "latest",
                                                          "--max_train_updates", "1"))
    assert f"No checkpoint in {tmp_path / 'new' / 'checkpoints'} (the folder does not exist): starting from the base model." in first_start.stdout


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_run_folder_does_not_silently_replace_this_folders_export(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    """Starting from another folder's checkpoint into a folder that holds an exported model is refused as a fresh
    start is; with --overwrite_run it starts from that checkpoint, the export moved aside. --overwrite_run with a
    checkpoint of this very folder would delete what it resumes from: refused."""
    other = copy_of(saved_run, tmp_path / "other")
    target = tmp_path / "target"
    exported = target / "pipeline"
    exported.mkdir(parents=True)
    (exported / "marker").write_text("the earlier run's model")
    other_checkpoint = other / "checkpoints" / checkpoint_name(4)
    from_other = [*trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "target", *QUICK), "--load_saved_state", str(other_checkpoint)]
    refused = run_processes(1, TRAINER, from_other, expect_success=False, timeout=300)
    assert refused.returncode == 1, (refused.stdout + refused.stderr)[-3000:]
    expected = f"{target} holds an earlier run (pipeline), which starting from {other_checkpoint} (a checkpoint of another run folder) would overwrite"
    assert refused.stderr.count(expected) == 1, refused.stderr[-3000:]
    assert "give this run another --project_name, or start over in this folder with --overwrite_run" in refused.stderr
    assert (exported / "marker").is_file()

    started = run_processes(1, TRAINER, [*from_other, "--overwrite_run", "--max_train_updates", "5"])
    assert f"Resumed from {other_checkpoint}" in started.stdout
    aside = [path for path in target.iterdir() if path.name.startswith("overwritten_")]
    assert len(aside) == 1 and (aside[0] / "pipeline" / "marker").is_file()
    assert [path.name for path in complete_checkpoints(target / "checkpoints")] == [checkpoint_name(5)]

    own = target / "checkpoints" / checkpoint_name(5)
    refused_own = run_processes(1, TRAINER, [*from_other[:-1], str(own), "--overwrite_run"], expect_success=False, timeout=300)
    assert refused_own.returncode == 1
    assert f"--overwrite_run would delete {target / 'checkpoints'}, which holds {own}" in refused_own.stderr, refused_own.stderr[-3000:]
    assert own.is_dir()


@pytest.mark.multiprocess
def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside_and_keeps_the_resumed_runs(tmp_path, saved_run, sample_cache_dir, tiny_pipeline_dir):
    """Going back to update 4 of a run that saved 4, 8 and 12, keeping 2: while 8 and 12 stayed, the limit (it
    keeps the highest update numbers) deleted each new save and the one resumed from, and 'latest' then
    continued the abandoned branch."""
    run = copy_of(saved_run, tmp_path)
    checkpoints = run / "checkpoints"
    result = run_processes(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--load_saved_state", str(checkpoints / checkpoint_name(4)),
                                                   "--checkpoints_total_limit", "2", "--save_state_every_n_updates", "3", "--max_train_updates", "10"))
    aside = [path for path in checkpoints.iterdir() if path.name.startswith(f"abandoned_after_{checkpoint_name(4)}_")]
    assert len(aside) == 1, sorted(path.name for path in checkpoints.iterdir())
    assert f"({checkpoint_name(8)}, {checkpoint_name(12)}): moved them to {aside[0]}" in result.stdout
    assert sorted(path.name for path in aside[0].iterdir()) == [checkpoint_name(8), checkpoint_name(12)]
    assert all(checkpoint_problem(path) is None for path in aside[0].iterdir())  # set aside whole, not deleted
    assert [path.name for path in complete_checkpoints(checkpoints)] == [checkpoint_name(9), checkpoint_name(10)]  # saved at 6, 9 and the end
    assert find_latest_checkpoint(checkpoints)[0] == checkpoints / checkpoint_name(10)


# ---- a fault in one rank, a killed launcher ----------------------------------------------------------


@pytest.fixture(scope="module")
def one_item_per_shard_cache(tmp_path_factory, tiny_pipeline_dir) -> Path:

    cache_dir = tmp_path_factory.mktemp("cache") / "one_per_shard"
    assert process_data_dir(
        ["--data_dir", str(REPO_ROOT / "sample_dataset"), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         *SAMPLE_RESOLUTION_FLAGS, "--items_per_shard", "1"]
    ) == 0
    return cache_dir


@pytest.mark.multiprocess
def test_an_error_in_one_rank_ends_every_process_at_once_with_its_message_printed_once(tmp_path, one_item_per_shard_cache, tiny_pipeline_dir):
    cache = tmp_path / "cache"
    shutil.copytree(one_item_per_shard_cache, cache)
    # The shard of one item of the largest bucket disappears: the rank that draws it fails, the other waits in
    # a collective. DataLoader workers (which ignore SIGTERM) are on, as in real runs.
    manifest = pq.read_table(next((cache / "manifest").glob("*.parquet"))).to_pylist()
    buckets = Counter((row["bucket_width"], row["bucket_height"]) for row in manifest)
    largest = max(buckets, key=buckets.get)
    lost = cache / "shards" / next(row["shard"] for row in manifest if (row["bucket_width"], row["bucket_height"]) == largest)
    lost.unlink()
    started = time.monotonic()
    result = run_processes(
        2, TRAINER, train_flags(cache, tiny_pipeline_dir, tmp_path, "--no-validation_image", "--dataloader_num_workers", "2"),
        expect_success=False, timeout=300, through_launcher=True,
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(f"{lost}") >= 1 and output.count("The whole job is stopping (exit code 1)") == 1, output[-3000:]
    # The other rank, on the same machine, ends without a word, and the launcher adds nothing: the message stays last.
    assert "Stopping because rank" not in output and "ChildFailedError" not in output
    assert f"cache shard {lost} is damaged" in result.stderr.rstrip().splitlines()[-1]
    print(f"job ended {elapsed:.1f} s after start")
    # Ended by the job, not by a collective's timeout (run_processes would have given up): no rank or DataLoader
    # worker outlives the launcher (a killed worker may take a moment to leave the process table).
    settle = time.monotonic() + 30
    while run_processes_of(str(tmp_path)) and time.monotonic() < settle:
        time.sleep(0.5)
    assert run_processes_of(str(tmp_path)) == []


def run_processes_of(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (the ranks and their DataLoader workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command_line = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in command_line and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


@pytest.mark.multiprocess
def test_killing_only_the_launcher_leaves_no_rank_training_on(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    output_dir = tmp_path / "killed_launcher_output"
    command = launcher_command(2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, output_dir, "--num_train_epochs", "50", "--dataloader_num_workers", "2",
                                                       "--save_state_every_n_updates", "5"))
    launcher = subprocess.Popen(command, cwd=REPO_ROOT, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoints = output_dir / "run" / "checkpoints"
    deadline = time.monotonic() + 240
    while find_latest_checkpoint(checkpoints)[0] is None and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.5)
    assert find_latest_checkpoint(checkpoints)[0] is not None, "training never got going"
    assert len(run_processes_of(str(output_dir))) >= 3  # the launcher and two ranks (and their workers)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while run_processes_of(str(output_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = run_processes_of(str(output_dir))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} trained on after their launcher was killed"
    saved = sorted(path.name for path in checkpoints.iterdir())
    time.sleep(3)
    assert sorted(path.name for path in checkpoints.iterdir()) == saved  # nothing writes into the run any more


# ---- a full disk ----------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_full_disk_warns_at_state_saves_keeps_the_last_checkpoint_and_stops_cleanly_at_the_export(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """A checkpoint of the tiny model takes about 15 MB and its fp32 export 28 MB: on a 24 MB disk the save
    after update 4 fits, the one after update 8 does not, and neither does the export."""
    mounted, copied = tmp_path / "disk", tmp_path / "copied"
    result = run_processes(
        2, TRAINER, train_flags(sample_cache_dir, tiny_pipeline_dir, mounted, "--save_state_every_n_updates", "4", "--checkpoints_total_limit", "0", "--max_train_updates", "12",
                                              "--save_diffusers"),
        expect_success=False, prefix=small_filesystem_prefix(mounted, copied, "24m"),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    checkpoints = copied / "run" / "checkpoints"
    assert f"Could not save a checkpoint to {mounted / 'run' / 'checkpoints' / checkpoint_name(8)} (the disk is full). Earlier checkpoints are untouched." in output
    assert "Training goes on." in output
    assert f"Could not export the model to {mounted / 'run' / 'pipeline'} (the disk is full); nothing there was replaced." in output
    assert output.count("nothing there was replaced") == 1
    assert sorted(path.name for path in checkpoints.iterdir()) == [checkpoint_name(4)]  # no partial .tmp folder left
    assert checkpoint_problem(checkpoints / checkpoint_name(4)) is None
    assert not [path for path in (copied / "run").iterdir() if path.name.startswith((".pipeline", "pipeline"))]
    assert len(scalars(copied / "run", "train/loss")) == 12  # training went on after the failed saves


# ---- bad flags -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--learning_rate=-1e-5"], "--learning_rate must be > 0, got -1e-05"),
        (["--dataloader_num_workers=-1"], "--dataloader_num_workers must be >= 0, got -1"),
        (["--weight_decay=-0.1"], "--weight_decay must be >= 0"),
        (["--adam_beta2", "1.5"], "--adam_beta2 must be in [0, 1), got 1.5"),
        (["--adam_epsilon", "0"], "--adam_epsilon must be > 0"),
        (["--lr_num_cycles", "0"], "--lr_num_cycles must be at least 1"),
        (["--learning_rate_scheduler", "polynomial", "--polynomial_lr_end", "1e-3"], "--polynomial_lr_end (0.001) must be below --learning_rate"),
        (["--load_saved_state", "/nonexistent/update_00000004"], "--load_saved_state /nonexistent/update_00000004 is not a folder"),
        (["--overwrite_run", "--load_saved_state", "latest"], "--overwrite_run starts the run over, --load_saved_state latest continues it"),
        (["--delete_abandoned_branches"], "--delete_abandoned_branches only applies with --overwrite_run"),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(flags, message, capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_wrong_model_path_is_named_before_anything_loads(tmp_path, sample_cache_dir):
    from sdxl_trainer.models.single_file import model_location_problem

    assert "is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in model_location_problem("someone/not-downloaded", "--flag")
    assert "is neither an existing file or folder nor a Hugging Face model id" in model_location_problem("bad name!", "--flag")
    missing = tmp_path / "models" / "sdxl.safetensors"
    result = run_processes(
        1, TRAINER, ["--cached_dataset_dirs", str(sample_cache_dir), "--pretrained_model_name_or_path", str(missing), "--output_dir", str(tmp_path)],
        expect_success=False, timeout=300,
    )
    assert result.returncode == 1
    assert f"--pretrained_model_name_or_path {missing} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
