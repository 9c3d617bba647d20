"""--replicate_groups (HSDP): on 4 gloo processes as 2 groups of 2, the tiny UNet trains as under full
sharding to fp32 reduction noise, each rank holds half the weights (not a quarter) and the same shard as its
replica in the other group, the state resumes bitwise as HSDP and moves to full sharding; the flag's
problems are named."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes
from unet_batches import assert_clipped_as_torch

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.world import device_mesh
from sdxl_trainer.jobs.train_config import TrainConfig


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_pipeline_dir) -> list[dict]:
    output = tmp_path_factory.mktemp("hsdp")
    run_processes(4, REPO_ROOT / "tests" / "support" / "hsdp_worker.py", [str(tiny_pipeline_dir), str(output)])
    return [json.loads((output / f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,tolerance", [("adamw", 1e-5), ("adamw8bit", 1e-3)])
def test_hsdp_trains_like_full_sharding(reports, name, tolerance):
    """adamw: fp32 reduction order only. adamw8bit: the same differences can move a moment across one of its
    256 quantisation steps, so a weight may differ by a fraction of one update (learning rate 1e-3)."""
    for report in reports:
        result = report[name]
        assert result["placements"] == ["R", "S(0)"]  # replicated across the groups, sharded within one
        assert 0 < result["hsdp_vs_full"] <= tolerance


@pytest.mark.multiprocess
def test_hsdp_state_resumes_in_either_layout(reports):
    """8-bit AdamW's quantised state (AdamW's moments are laid out as the weights, compared in both resumes)."""
    for report in reports:
        assert report["adamw8bit"]["resumed_as_hsdp_vs_hsdp"] == 0.0
        assert report["adamw8bit"]["resumed_as_full_vs_hsdp"] <= 1e-6


@pytest.mark.multiprocess
def test_each_rank_holds_its_groups_share_and_the_same_shard_as_its_replica(reports):
    for name in ("adamw", "adamw8bit"):
        local_bytes = [report[name]["local_bytes"] for report in reports]
        assert all(entry["hsdp"] == 2 * entry["full"] for entry in local_bytes)  # 1/2 of the UNet against 1/4
        checksums = [report[name]["local_checksum"] for report in reports]
        assert checksums[0] == checksums[2] and checksums[1] == checksums[3]  # ranks r and r + 2: one shard, two replicas
        assert checksums[0] != checksums[1]


@pytest.mark.multiprocess
def test_clipping_on_local_shards_gives_torchs_norm_and_gradients_under_hsdp(reports):
    for report in reports:
        assert_clipped_as_torch(report["clipping"])
    assert reports[0]["clipping"]["1.0"]["ours"] == reports[2]["clipping"]["1.0"]["ours"]


def test_groups_that_do_not_divide_the_processes_are_refused():
    with pytest.raises(SystemExit, match=r"--replicate_groups 3 does not divide the 4 processes into equal groups"):
        device_mesh("cpu", 4, 3)


def test_replicate_groups_are_checked_with_the_flags(capsys):
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "unused", "--replicate_groups", "0"])
    assert "--replicate_groups must be >= 1" in capsys.readouterr().err


def test_the_memory_estimate_of_hsdp_is_full_sharding_over_one_group():
    from sdxl_trainer.jobs.train_config import memory_settings

    flags = ["--cached_dataset_dirs", "unused", "--estimate_memory", "--estimate_gpus", "32"]
    (full,) = memory_settings(parse_config(TrainConfig, flags))
    (hsdp,) = memory_settings(parse_config(TrainConfig, [*flags, "--replicate_groups", "4"]))
    assert (full.world_size, hsdp.world_size) == (32, 8)
