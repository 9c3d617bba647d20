"""The speed estimate (sdxl_trainer/estimates/speed_estimate.py): the bytes it says FSDP2's collectives move, against
what the real collectives moved (2 and 4 gloo processes on the tiny UNet, full sharding and HSDP; the full-size
UNet over the fake process group of --estimate_memory), its overlap of compute and communication on made-up
units whose answer is worked out by hand, the work Adafactor's and CAME's steps do per run of same-shaped
tensors, and the figures README's hardware table gives for the shipped configs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from collective_bytes_worker import LAYOUTS
from conftest import REPO_ROOT, run_processes
from diffusers import UNet2DConditionModel
from factored_step_work import OPTIMIZERS, recount

from sdxl_trainer.config import parse_config
from sdxl_trainer.estimates.speed_estimate import (
    FACTORED_STEP_WORK,
    GPUS,
    LINKS,
    SpeedSettings,
    Unit,
    _Timeline,
    collective_bytes,
    estimate_speed,
    factored_step_runs,
    sdxl_units,
    units_of,
)
from sdxl_trainer.jobs.train_config import TrainConfig, speed_settings
from sdxl_trainer.models.tiny import TINY_UNET_CONFIG

SHIPPED_CONFIGS = ("1x24gb_bf16.toml", "2x24gb_consumer.toml", "8x80gb_datacenter.toml", "multinode_4x8x80gb.toml")


def speed(**changes) -> SpeedSettings:
    values = dict(
        gpus=2, replicate_groups=1, train_batch_size=2, gradient_accumulation_steps=2, resolution=1024, compute_bytes=2,
        gradient_checkpointing=True, reshard_after_forward=True, reduce_every_microbatch=False, gpu="h100", interconnect="nvlink4",
    )  # fmt: skip
    return SpeedSettings(**{**values, **changes})


def tiny_units() -> list[Unit]:
    with torch.device("meta"):
        return units_of(UNet2DConditionModel(**TINY_UNET_CONFIG), 128)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("processes", "replicate_groups"), [(2, "1"), (4, "1,2")])
def test_the_estimate_counts_the_bytes_the_real_collectives_move(tmp_path, tiny_pipeline_dir, processes, replicate_groups):
    run_processes(processes, REPO_ROOT / "tests" / "support" / "collective_bytes_worker.py", [str(tiny_pipeline_dir), str(tmp_path), replicate_groups])
    units = tiny_units()
    for rank in range(processes):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(measured) == sorted(replicate_groups.split(","))
        for groups, layouts in measured.items():
            for name, (reshard_after_forward, reduce_every_microbatch, reduce_dtype) in LAYOUTS.items():
                settings = speed(gpus=processes, replicate_groups=int(groups), compute_bytes=4, reshard_after_forward=reshard_after_forward,
                                 reduce_every_microbatch=reduce_every_microbatch, reduce_bytes=reduce_dtype.itemsize)  # fmt: skip
                assert measured[groups][name]["bytes"] == collective_bytes(units, settings), (rank, groups, name)
                # Full sharding: each unit for forward and again for backward but the root, in each of the 2 microbatches;
                # otherwise each unit once per update.
                gathers = (2 * len(units) - 1) * 2 if reshard_after_forward else len(units)
                reductions = len(units) * (2 if reduce_every_microbatch else 1)
                assert measured[groups][name]["calls"] == {"all_gather": gathers, "reduce_scatter": reductions,
                                                           "all_reduce": reductions if int(groups) > 1 else 0}, (rank, groups, name)  # fmt: skip


@pytest.mark.slow
def test_the_full_size_count_matches_the_collectives_of_a_fake_8_gpu_update():
    """The memory estimate's fake 8-GPU update of the full-size UNet (bf16 gathers, 2 microbatches reduced on
    each): 78 units, each gathered twice per microbatch but the root (once), 20.5 GB gathered and as much
    reduce-scattered (fp32)."""
    from sdxl_trainer.estimates.collective_count import count_collectives
    from sdxl_trainer.estimates.fake_run import EstimateSettings

    counted = count_collectives(EstimateSettings(
        world_size=8, train_batch_size=1, gradient_accumulation_steps=2, resolution=512, compute_dtype=torch.bfloat16, optimizer="adamw8bit",
        gradient_checkpointing=True, reshard_after_forward=True, reduce_every_microbatch=True, cpu_offload=False, use_ema=False, ema_on_cpu=False,
    ))  # fmt: skip
    units = sdxl_units(512)
    settings = speed(gpus=8, train_batch_size=1, resolution=512, reduce_every_microbatch=True)
    assert counted.bytes == collective_bytes(units, settings)
    assert counted.calls == {"all_gather": (2 * len(units) - 1) * 2, "reduce_scatter": len(units) * 2, "all_reduce": 0}
    assert len(units) == 78 and counted.bytes["all_gather"] == pytest.approx(20.51e9, rel=1e-3)


def test_the_units_hold_every_parameter_and_flop_of_the_full_size_unet():
    from torch.utils.flop_counter import FlopCounterMode

    from sdxl_trainer.models.sdxl import build_full_size_unet

    units = sdxl_units(1024)
    with torch.device("meta"):
        unet = build_full_size_unet()
    assert sum(sum(torch.Size(shape).numel() for shape in unit.shapes) for unit in units) == sum(parameter.numel() for parameter in unet.parameters())
    assert [unit.name for unit in units[:3]] == ["root", "down_blocks.0", "down_blocks.1"]
    assert sum(".transformer_blocks." in unit.name for unit in units) == 2 * 2 + 2 * 10 + 10 + 3 * 10 + 3 * 2  # down, mid, up
    side = 1024 // 8
    with torch.device("meta"), FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(torch.zeros(1, 4, side, side), torch.zeros(1, dtype=torch.long), encoder_hidden_states=torch.zeros(1, 77, 2048),
             added_cond_kwargs={"text_embeds": torch.zeros(1, 1280), "time_ids": torch.zeros(1, 6)})  # fmt: skip
    assert sum(unit.forward_flop for unit in units) == pytest.approx(counter.get_total_flops(), rel=1e-6)


def test_a_gather_shorter_than_the_compute_before_it_is_hidden():
    """Three units of 1 s compute: gathers of 0.5 s are hidden behind the previous unit's compute (only the first
    waits), gathers of 2 s are not (each unit waits for its own)."""
    hidden = _Timeline()
    hidden.forward([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    assert hidden.finish() == pytest.approx(0.5 + 3.0)
    exposed = _Timeline()
    exposed.forward([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert exposed.finish() == pytest.approx(2.0 + 2.0 + 2.0 + 1.0)
    backward = _Timeline()
    backward.backward([2.0, 2.0, 2.0], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    # first gather 0.5; the last unit's reduce-scatter (1 s) follows the last backward, the others hide
    assert backward.finish() == pytest.approx(0.5 + 6.0 + 1.0)
    assert backward.link_busy == pytest.approx(3 * 0.5 + 3 * 1.0)


def test_one_gpu_has_no_communication_and_a_fast_link_hides_it():
    alone = estimate_speed(speed(gpus=1))
    assert alone.collective_bytes == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    assert alone.exposed_communication_seconds == pytest.approx(0, abs=1e-9) and alone.update_seconds == pytest.approx(alone.compute_seconds + alone.optimizer_seconds)
    eight = estimate_speed(speed(gpus=8, train_batch_size=8))
    assert eight.exposed_communication_seconds < 0.02 * eight.update_seconds
    assert eight.images_per_second / 8 == pytest.approx(estimate_speed(speed(gpus=1, train_batch_size=8)).images_per_second, rel=0.02)


def test_each_optimizers_step_is_its_memory_traffic_or_the_measured_host_floor():
    """At full size on one RTX 4090 Prodigy's two passes (52 bytes a value) take longer than the host floor (the
    8-bit step's time measured on an H200); the 8-bit step (16 bytes) and schedule-free AdamW (28) stay at the
    floor, and on 8 GPUs every shard is small enough for the floor. The flag reaches the estimate."""
    values = sum(math.prod(shape) for unit in sdxl_units(1024) for shape in unit.shapes)
    floor = estimate_speed(speed(gpus=1, gpu="4090")).optimizer_seconds
    prodigy = estimate_speed(speed(gpus=1, gpu="4090", optimizer="prodigy"))
    assert prodigy.optimizer_seconds == pytest.approx(52 * values / (GPUS["4090"].memory_bandwidth * 0.7)) and prodigy.optimizer_seconds > floor
    assert estimate_speed(speed(gpus=1, gpu="4090", optimizer="adamw_schedulefree")).optimizer_seconds == floor
    assert estimate_speed(speed(gpus=8, gpu="4090", optimizer="prodigy")).optimizer_seconds == floor
    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", "prodigy", "--learning_rate", "1", "--estimate_speed"])
    assert speed_settings(config).optimizer == "prodigy"


def test_a_slow_link_shows_in_the_update_and_the_advice():
    fast, slow = estimate_speed(speed(gpus=2, train_batch_size=1)), estimate_speed(speed(gpus=2, train_batch_size=1, interconnect="eth100"))
    assert slow.collective_bytes == fast.collective_bytes
    assert slow.communication_seconds == pytest.approx(fast.communication_seconds * LINKS["nvlink4"].bandwidth / LINKS["eth100"].bandwidth)
    assert slow.update_seconds - fast.update_seconds == pytest.approx(slow.exposed_communication_seconds - fast.exposed_communication_seconds)
    assert slow.exposed_communication_seconds > 0.3 * slow.update_seconds
    report = slow.report()
    assert "waits for the link: try a larger --train_batch_size" in report and "--no-reshard_after_forward" in report
    assert "waits for the link" not in fast.report()
    once = estimate_speed(speed(gpus=2, train_batch_size=1, interconnect="eth100", reshard_after_forward=False))
    # Full sharding gathers every unit for forward and again for backward, but the root (kept gathered) and, over 2
    # microbatches, twice; without it each unit is gathered once per update.
    root = next(unit for unit in sdxl_units(1024) if unit.name == "root").padded_values(2) * 2 * 2
    assert slow.collective_bytes["all_gather"] == 2 * (2 * once.collective_bytes["all_gather"] - root) and once.update_seconds < slow.update_seconds


def test_hsdp_gathers_inside_each_machine_and_reduces_across():
    full = estimate_speed(speed(gpus=16, train_batch_size=4, interconnect="eth100"))
    hsdp = estimate_speed(speed(gpus=16, replicate_groups=2, train_batch_size=4, interconnect="eth100"))
    assert hsdp.collective_bytes["all_reduce"] > 0 == full.collective_bytes["all_reduce"]
    assert hsdp.update_seconds < full.update_seconds
    assert "(HSDP; nvlink4 inside, eth100 between)" in hsdp.report() and "--replicate_groups MACHINES" in full.report()


def test_the_flags_pick_the_hardware_and_resolve_gradient_reduction(capsys):
    from sdxl_FSDP_train import main

    flags = ["--config", str(REPO_ROOT / "configs" / "2x24gb_consumer.toml"), "--estimate_speed"]
    settings = speed_settings(parse_config(TrainConfig, flags))
    assert (settings.gpus, settings.gpu, settings.interconnect, settings.train_batch_size, settings.gradient_accumulation_steps) == (2, "4090", "pcie4", 2, 4)
    assert settings.reduce_every_microbatch  # auto, on a 24 GB card with accumulation
    assert not speed_settings(parse_config(TrainConfig, [*flags, "--gpu", "h100"])).reduce_every_microbatch
    assert main([*flags, "--gpu", "3090"]) == 0
    printed = capsys.readouterr().out
    assert "2 x 3090 over pcie4, batch 2 x 2 GPU x 4 accumulation = 16 images per update at 1024 px" in printed
    assert re.search(r"against one 3090 with the same settings .*: x[\d.]+ with 2", printed)
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, [*flags, "--cpu_offload"])
    assert "--estimate_speed covers the UNet trained on the GPUs: not --cpu_offload" in capsys.readouterr().err


def test_the_hardware_tables_predictions_are_the_estimates_of_the_shipped_configs():
    """README's predicted column, per shipped config with the hardware its file names."""
    rows = {
        match["config"]: match
        for match in re.finditer(
            r"^\| `(?P<config>[\w.]+\.toml)` \|(?:[^|]*\|){4} predicted (?P<per_gpu>[\d.]+) img/s per GPU, (?P<job>[\d.]+) for the job(?P<rest>[^|]*)\|",
            (REPO_ROOT / "README.md").read_text(), re.MULTILINE,
        )
    }
    assert sorted(rows) == sorted(SHIPPED_CONFIGS)
    for name in SHIPPED_CONFIGS:
        settings = speed_settings(parse_config(TrainConfig, ["--config", str(REPO_ROOT / "configs" / name), "--estimate_speed"]))
        estimate = estimate_speed(settings)
        assert float(rows[name]["per_gpu"]) == round(estimate.images_per_second / settings.gpus, 2), name
        assert float(rows[name]["job"]) == round(estimate.images_per_second, 2), name


def stated(work) -> dict:
    """FACTORED_STEP_WORK's entry as factored_step_work.recount reports it."""
    return {
        "ops_per_update": work.ops_per_update,
        "ops_per_run": {"factored": work.factored.ops, "unfactored": work.unfactored.ops},
        "bytes_per_value": {"factored": pytest.approx(work.factored.bytes_per_value, rel=0.02), "unfactored": pytest.approx(work.unfactored.bytes_per_value, rel=0.02)},
        "ops_of_one_more_tensor_of_a_shape": 0,
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_factored_step_work_over_whole_tensors_is_what_the_step_does(name):
    """FACTORED_STEP_WORK over whole tensors (one process), recounted: operators per update and per run of each
    kind, none for one more tensor of a shape (it joins that shape's run), bytes per value of each kind."""
    assert recount(OPTIMIZERS[name]) == stated(FACTORED_STEP_WORK[(name, False)])


def test_factored_step_work_over_shards_is_what_the_step_does(tmp_path):
    """The same over FSDP2's dim-0 shards on 2 processes, rank 0's: each run's update worked out twice."""
    run_processes(2, REPO_ROOT / "tests" / "support" / "factored_step_work.py", [str(tmp_path)])
    report = json.loads((tmp_path / "rank0.json").read_text())
    for name in OPTIMIZERS:
        assert report[name] == stated(FACTORED_STEP_WORK[(name, True)]), name


def test_the_runs_priced_are_the_runs_the_step_makes():
    """factored_step_runs, from shapes alone, makes the runs shards.stacked_runs makes of the full-size UNet's
    parameters (on the meta device); on 8 ranks, rank 0's runs hold its shards' values (dim 0 padded and
    split, as FSDP2 splits it)."""
    from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG
    from sdxl_trainer.optimizers.shards import _Entry, stacked_runs

    with torch.device("meta"):
        parameters = list(UNet2DConditionModel(**SDXL_UNET_CONFIG).parameters())
    shapes = [tuple(parameter.shape) for parameter in parameters]
    entries = [_Entry(index, parameter, parameter, parameter, {}) for index, parameter in enumerate(parameters)]
    made = sorted(("factored" if run.factored else "unfactored", sum(entry.weights.numel() for entry in run.entries)) for run in stacked_runs(entries))
    assert sorted(factored_step_runs(shapes, 1)) == made
    assert len(made) == 204  # 44 shapes, the largest groups (616 biases of 1,280, 381 weights of 1,280 x 1,280) in several runs
    rank_runs = factored_step_runs(shapes, 8)
    assert sum(values for _, values in rank_runs) == sum(-(-shape[0] // 8) * math.prod(shape[1:]) for shape in shapes)


@pytest.mark.parametrize("name, shown", [("adafactor", "Adafactor"), ("came", "CAME")])
def test_a_factored_optimizer_is_priced_by_its_own_step_and_the_flag_reaches_the_estimate(name, shown):
    assert estimate_speed(speed(optimizer=name)).optimizer_seconds != estimate_speed(speed()).optimizer_seconds
    config = parse_config(TrainConfig, ["--config", str(REPO_ROOT / "configs" / "2x24gb_consumer.toml"), "--estimate_speed", "--optimizer", name])
    assert speed_settings(config).optimizer == name
    assert f"optimizer: {shown}'s step by its operators counted per run of same-shaped tensors" in estimate_speed(speed_settings(config)).report()
