"""Per-block learning rates (--block_lr, sdxl_trainer/training/block_rates.py): kohya sd-scripts' split of
SDXL's UNet into 23 blocks, each block's update at its rate under the schedule, a frozen block at 0, an
exact resume, the checks of the flag, and the trainer run with it on 2 processes, resumed bitwise. One
update on FSDP2 shards (param groups of DTensors): test_train_step_distributed.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import scalars
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file
from trainer_runs import RESUME_AT, exported_unet, resumed_copy, train
from unet_batches import (
    TINY_BLOCK_RATES, assert_each_block_moved_by_its_rate, largest_change_per_block, make_train_step, save_training_state, saved_state_of, synthetic_batch,
    trainer_state_for,
)

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.fsdp import prepare_unet
from sdxl_trainer.jobs.train_build import block_rate_problems
from sdxl_trainer.jobs.train_config import TrainConfig
from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.tiny import TINY_UNET_CONFIG, build_tiny_text_encoders
from sdxl_trainer.optimizers.build import build_optimizer
from sdxl_trainer.state.checkpointer import resume_problems
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.training.block_rates import block_count_problem, freeze_zero_rate_blocks, unet_block_count, unet_blocks
from sdxl_trainer.training.lr_schedule import LR_SCALE, LearningRateSchedule, set_learning_rate
from sdxl_trainer.training.trained_models import TrainedModels


def _up_level(level: int, attention: bool, upsampler: bool) -> list[tuple[str, ...]]:
    layers = [(f"up_blocks.{level}.resnets.{layer}.", *((f"up_blocks.{level}.attentions.{layer}.",) if attention else ())) for layer in range(3)]
    if upsampler:
        layers[-1] += (f"up_blocks.{level}.upsamplers.0.",)
    return layers


# kohya's sdxl_train.py names its blocks by the original UNet's modules: 0 time_embed and label_emb, 1-9
# input_blocks 0-8, 10-12 middle_block 0-2, 13-21 output_blocks 0-8, 22 out. The same modules by their
# diffusers names, written out by hand:
SDXL_BLOCKS = [
    ("time_embedding.", "add_embedding."),
    ("conv_in.",),
    ("down_blocks.0.resnets.0.",), ("down_blocks.0.resnets.1.",), ("down_blocks.0.downsamplers.0.",),
    ("down_blocks.1.resnets.0.", "down_blocks.1.attentions.0."), ("down_blocks.1.resnets.1.", "down_blocks.1.attentions.1."),
    ("down_blocks.1.downsamplers.0.",),
    ("down_blocks.2.resnets.0.", "down_blocks.2.attentions.0."), ("down_blocks.2.resnets.1.", "down_blocks.2.attentions.1."),
    ("mid_block.resnets.0.",), ("mid_block.attentions.0.",), ("mid_block.resnets.1.",),
    *_up_level(0, attention=True, upsampler=True), *_up_level(1, attention=True, upsampler=True), *_up_level(2, attention=False, upsampler=False),
    ("conv_norm_out.", "conv_out."),
]  # fmt: skip


def test_the_sdxl_unet_splits_into_kohyas_23_blocks_in_its_order():
    with torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET_CONFIG)
    assert unet_block_count(unet.config) == len(SDXL_BLOCKS) == 23
    names = {parameter: name for name, parameter in unet.named_parameters()}
    blocks = unet_blocks(unet)
    for number, (block, prefixes) in enumerate(zip(blocks, SDXL_BLOCKS, strict=True)):
        expected = {name for name in names.values() if name.startswith(prefixes)}
        assert {names[parameter] for parameter in block} == expected, f"block {number}"
    assert sum(len(block) for block in blocks) == len(names)  # every parameter in exactly one block


def tiny_unet(pipeline_dir, world, block_rates: list[float]) -> UNet2DConditionModel:
    """The tiny UNet as build_models prepares it for one process: the blocks at 0 frozen, then prepared."""
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    freeze_zero_rate_blocks(unet, block_rates)
    return prepare_unet(unet, world, param_dtype=None)


TINY_RATES = TINY_BLOCK_RATES


def test_each_block_moves_by_its_own_rate_and_a_block_at_0_stays(world, tiny_pipeline_dir):
    unet = tiny_unet(tiny_pipeline_dir, world, TINY_RATES)
    changes = largest_change_per_block(unet, tiny_pipeline_dir, TINY_RATES, synthetic_batch(unet, [0, 1], seed=3, height=16, width=16))
    assert_each_block_moved_by_its_rate(changes, TINY_RATES)
    frozen = [parameter for block in (3, 12) for parameter in unet_blocks(unet)[block]]
    assert frozen and all(not parameter.requires_grad and parameter.grad is None for parameter in frozen)


def test_the_schedule_scales_every_block_and_a_resume_continues_exactly(world, tiny_pipeline_dir, tmp_path):
    """A warm-up over 3 updates: each block's rate is its --block_lr times the schedule's factor. "2 updates
    straight" equals "1 update, save, restore into a fresh UNet and optimizer built from the same rates, 1
    update" bit for bit, at the same rates."""
    learning_rate = 1e-3
    schedule = LearningRateSchedule("constant_with_warmup", learning_rate, warmup_updates=3, total_updates=4)

    def fresh():
        unet = tiny_unet(tiny_pipeline_dir, world, TINY_RATES)
        optimizer = build_optimizer("adamw", TrainedModels(unet).parameter_groups(learning_rate, {}, TINY_RATES), learning_rate, 1e-2, (0.9, None), 1e-8)
        return unet, optimizer, make_train_step(unet, optimizer, tiny_pipeline_dir, schedule=schedule)

    def rates(optimizer) -> list[float]:
        return [group["lr"] for group in optimizer.param_groups]

    def batch(unet, update: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(unet, [2 * update, 2 * update + 1], seed=update, height=16, width=16)

    trained_rates = [rate for rate in TINY_RATES if rate]
    unet, optimizer, step = fresh()
    step([batch(unet, 0)], epoch=0)
    state, position = saved_state_of(step, "adamw", 1)
    save_training_state(tmp_path / "checkpoint", unet, optimizer, None, state, position)
    step([batch(unet, 1)], epoch=0)
    assert rates(optimizer) == pytest.approx([rate * schedule.factor(1) for rate in trained_rates], rel=1e-12)
    straight = {name: parameter.detach().clone() for name, parameter in unet.named_parameters()}

    unet, optimizer, step = fresh()
    saved, _ = load_training_state(tmp_path / "checkpoint", unet, optimizer, None)
    step.load_state_dict(dataclasses.asdict(saved))
    step([batch(unet, 1)], epoch=0)
    assert rates(optimizer) == pytest.approx([rate * schedule.factor(1) for rate in trained_rates], rel=1e-12)
    assert all(torch.equal(straight[name], parameter) for name, parameter in unet.named_parameters())


def test_trained_text_encoders_keep_their_own_rates_beside_the_blocks():
    """--block_lr with --train_text_encoder: a group per trained block, then each encoder's group at
    --learning_rate_te1 / te2; the schedule's factor scales them all."""
    unet = UNet2DConditionModel(**TINY_UNET_CONFIG)
    models = TrainedModels(unet, dict(zip(TEXT_ENCODER_NAMES, build_tiny_text_encoders())))
    learning_rate, encoder_rates = 1e-3, {"text_encoder": 2e-4, "text_encoder_2": 5e-5}
    optimizer = torch.optim.SGD(models.parameter_groups(learning_rate, encoder_rates, TINY_RATES), lr=learning_rate)
    set_learning_rate(optimizer, 0.5 * learning_rate)
    trained_blocks = [rate for rate in TINY_RATES if rate]
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.5 * rate for rate in [*trained_blocks, 2e-4, 5e-5]], rel=1e-12)
    assert [group[LR_SCALE] for group in optimizer.param_groups] == pytest.approx([rate / learning_rate for rate in [*trained_blocks, 2e-4, 5e-5]])
    encoders = [parameter for name in TEXT_ENCODER_NAMES for parameter in getattr(models, name).parameters() if parameter.requires_grad]
    assert [parameter for group in optimizer.param_groups[-2:] for parameter in group["params"]] == encoders


def test_the_rates_must_match_the_unets_blocks_before_anything_loads(tiny_pipeline_dir, sample_cache_dir, tmp_path):
    """The count is checked against the model's UNet config when the run starts (check_before_start)."""
    def config(rates: list[float]) -> TrainConfig:
        flags = ["--cached_dataset_dirs", str(sample_cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir), "--output_dir", str(tmp_path)]
        return parse_config(TrainConfig, [*flags, "--block_lr", *map(str, rates)], quiet=True)

    assert block_rate_problems(config(TINY_RATES)) == []
    assert block_rate_problems(config([1e-5] * 23)) == [
        "--block_lr has 23 values, but this UNet has 13 blocks (kohya's split; SDXL's has 23): give one rate per block"
    ]
    assert block_count_problem([1e-5] * 22, SDXL_UNET_CONFIG) is not None and block_count_problem([1e-5] * 23, SDXL_UNET_CONFIG) is None
    assert unet_block_count(TINY_UNET_CONFIG) == 13


@pytest.mark.parametrize(
    ("rates", "message"),
    [
        (["1e-5", "-0.5"], "--block_lr rates must be >= 0 (0 keeps that block frozen)"),
        (["0", "0"], "--block_lr gives every UNet block 0, so the UNet would not train"),
    ],
)
def test_the_flag_refuses_negative_rates_and_a_unet_with_nothing_to_train(rates, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "cache", "--block_lr", *rates])
    assert message in capsys.readouterr().err


def test_a_resume_keeps_the_same_blocks_frozen():
    """The checkpoint's optimizer state holds the trained blocks only: another set of frozen blocks is refused."""
    def facts(*rates: str):
        return parse_config(TrainConfig, ["--cached_dataset_dirs", "cache", "--block_lr", *rates], quiet=True).run_facts(2)

    saved = trainer_state_for(frozen_unet_blocks="1")
    assert resume_problems(saved, facts("1e-5", "0", "1e-5"), None) == []
    assert resume_problems(saved, facts("1e-5", "2e-5", "3e-5"), None) == [
        "the checkpoint kept UNet blocks 1 frozen: resume with --block_lr 0 at exactly those blocks"
    ]
    assert resume_problems(trainer_state_for(), facts("0", "1e-5", "0"), None) == [
        "the checkpoint trained every UNet block: resume with no 0 in --block_lr (this run freezes blocks 0,2)"
    ]


@pytest.mark.multiprocess
def test_the_trainer_trains_each_block_at_its_rate_on_2_processes_and_resumes_bitwise(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """sdxl_FSDP_train.py with --block_lr (two blocks at 0) under a warm-up and decay: the frozen blocks are
    exported as the base model's, the rest trained; resumed from update 2, the export is the straight run's."""
    rates = ("--block_lr", *map(str, TINY_RATES))
    straight = train(tmp_path / "straight", sample_cache_dir, tiny_pipeline_dir, "cosine", *rates)
    resumed_copy(straight, tmp_path / "resumed")
    resumed = train(tmp_path / "resumed", sample_cache_dir, tiny_pipeline_dir, "cosine", *rates, "--load_saved_state", "latest")
    assert scalars(resumed, "train/loss") == scalars(straight, "train/loss")[RESUME_AT:]
    expected, got = exported_unet(straight), exported_unet(resumed)
    assert all(torch.equal(expected[key], got[key]) for key in expected)

    base = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**TINY_UNET_CONFIG)
    names = {parameter: name for name, parameter in unet.named_parameters()}
    for block, (rate, parameters) in enumerate(zip(TINY_RATES, unet_blocks(unet), strict=True)):
        unchanged = [torch.equal(expected[names[parameter]], base[names[parameter]]) for parameter in parameters]
        assert all(unchanged) if rate == 0 else not any(unchanged), f"block {block} at rate {rate}"
