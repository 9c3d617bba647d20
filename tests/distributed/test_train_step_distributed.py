"""Optimizers, checkpoints, gradient sync and EMA on 2 CPU processes (gloo) with FSDP2 shards of the tiny UNet."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes
from safetensors.torch import load_file
from unet_batches import TINY_BLOCK_RATES, assert_clipped_as_torch, assert_each_block_moved_by_its_rate

from sdxl_trainer.optimizers.build import OPTIMIZERS

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_pipeline_dir) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("train_step_worker")
    run_processes(2, REPO_ROOT / "tests" / "support" / "train_step_worker.py", [str(tiny_pipeline_dir), str(output_dir)])
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_steps_saves_and_restores_exactly_on_two_ranks(reports, name):
    for report in reports:
        result = report["optimizers"][name]
        assert result["restored_update"] == 1
        assert result["max_difference"] == 0.0, f"{name}: resumed update differs by {result['max_difference']}"
    assert reports[0]["optimizers"][name]["first_loss"] == reports[1]["optimizers"][name]["first_loss"]  # all-reduced


def test_bf16_weights_resume_exactly_on_two_ranks(reports):
    for report in reports:
        assert report["bf16_weights"]["restored_update"] == 1
        assert report["bf16_weights"]["max_difference"] == 0.0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rank_holds_about_half_of_parameters_and_optimizer_state(reports, tiny_pipeline_dir, name):
    full_param_bytes = sum(tensor.numel() * 4 for tensor in load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors").values())
    per_rank = [report["optimizers"][name]["local_param_bytes"] + report["optimizers"][name]["local_state_bytes"] for report in reports]
    total_state = sum(report["optimizers"][name]["local_state_bytes"] for report in reports)
    # Adafactor's column statistics are replicated on purpose (they are tiny), so compare with the sum of both ranks.
    for share in (rank_bytes / (full_param_bytes + total_state) for rank_bytes in per_rank):
        assert share <= 0.55, f"{name}: a rank holds {share:.3f} of parameters + optimizer state"
    print(f"{name}: per-rank bytes {per_rank}, full parameters {full_param_bytes}, all optimizer state {total_state}")


def test_adafactor_sums_over_the_shards_in_two_all_reduces_per_step(reports):
    """The column statistics with the row means, then the update norms, of all parameters at once: DTensor
    ops made three per factored weight and one per other parameter (382 here, 3,268 for SDXL's UNet)."""
    assert [report["all_reduces"]["adafactor"] for report in reports] == [2, 2]


def test_came_sums_over_the_shards_in_three_all_reduces_per_step(reports):
    """Adafactor's two, and the instability's column statistics with its row means."""
    assert [report["all_reduces"]["came"] for report in reports] == [3, 3]


@pytest.mark.parametrize("name", ["adafactor", "came"])
def test_factored_optimizers_step_shards_as_one_process_steps_the_whole_weights(reports, name):
    """Column statistics, mean rows and update norms summed over both ranks' rows: the shards end where the
    whole tensors do, to the rounding of those sums (uneven shards and an empty one included)."""
    for report in reports:
        assert report["shards_against_whole"][name] < 1e-6


def test_gradients_are_reduced_once_per_update_whatever_the_accumulation(reports):
    for report in reports:
        counts = report["reduce_scatters"]
        assert counts["1"] > 0
        assert counts["3"] == counts["1"], f"3 microbatches reduce-scattered {counts['3']} times, 1 microbatch {counts['1']} times"


def test_reducing_every_microbatch_reduces_three_times_as_often_and_trains_the_same(reports):
    for report in reports:
        result = report["reduce_every_microbatch"]
        assert result["every"] == 3 * result["once"] > 0
        assert result["weights_max_difference"] < 1e-6  # the same sum, reduced in another order


def test_clipping_on_local_shards_gives_torchs_norm_and_gradients(reports):
    """clip_gradients sums the local shards' norms with one all-reduce; torch's clip_grad_norm_ over DTensors
    gives the reference."""
    norms = {report["clipping"]["1.0"]["ours"] for report in reports}
    assert len(norms) == 1  # every rank gets the global norm
    for report in reports:
        assert_clipped_as_torch(report["clipping"])


def test_ema_is_sharded(reports):
    for report in reports:
        assert report["ema_local_bytes"] == report["param_local_bytes"]  # fp32 copy of this rank's shard only
    assert reports[0]["ema_local_bytes"] + reports[1]["ema_local_bytes"] > 1.9 * reports[0]["ema_local_bytes"] > 0


def test_each_block_of_the_sharded_unet_moves_by_its_own_rate(reports):
    """--block_lr's param groups hold FSDP2's DTensor shards; two blocks were frozen before sharding."""
    for report in reports:
        assert_each_block_moved_by_its_rate(report["block_rate_changes"], TINY_BLOCK_RATES)
