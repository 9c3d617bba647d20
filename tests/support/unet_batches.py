"""Synthetic training batches shaped for a given SDXL UNet, and the pieces of a TrainStep around it,
for tests that exercise the update without a cache."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import UNet2DConditionModel
from torch.distributed.tensor import DTensor

from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.save import TensorStager, stage_training_state, write_staged_state
from sdxl_trainer.state.trainer_state import TrainerState
from sdxl_trainer.state.writer_process import WriterProcess, save_request
from sdxl_trainer.training.gradient_norm import clip_gradients
from sdxl_trainer.training.loss import build_noise_scheduler
from sdxl_trainer.training.lr_schedule import LearningRateSchedule
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.stream import DataPosition

TEXT_LENGTH = 77


def pooled_dim(unet: UNet2DConditionModel) -> int:
    config = unet.config
    return config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim


def synthetic_batch(unet: UNet2DConditionModel, item_indices: list[int], seed: int, height: int = 32, width: int = 24) -> dict[str, torch.Tensor]:
    """Latents, caption embeddings and SDXL time ids for the given items; every value depends on (seed, item)."""
    rows = []
    for item in item_indices:
        generator = torch.Generator().manual_seed(seed * 10_000 + item)
        rows.append(
            {
                "latents": torch.randn(unet.config.in_channels, height, width, generator=generator),
                "prompt_embeds": torch.randn(TEXT_LENGTH, unet.config.cross_attention_dim, generator=generator),
                "pooled_prompt_embeds": torch.randn(pooled_dim(unet), generator=generator),
                # original (h, w), crop (top, left), target (h, w): different for every item
                "time_ids": torch.tensor([height * 8 + item, width * 8 + 2 * item, item, 3 * item, height * 8, width * 8], dtype=torch.float32),
                "sample_index": torch.tensor(item),
            }
        )
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def empty_prompt_for(unet: UNet2DConditionModel) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((TEXT_LENGTH, unet.config.cross_attention_dim), 0.5), torch.full((pooled_dim(unet),), -0.5)


def make_train_step(
    unet, optimizer, pipeline_dir: Path, settings: NoiseSettings | None = None, max_grad_norm: float = 1.0, ema=None, prediction_type="epsilon",
    reduce_every_microbatch: bool = False, gather_once_per_update: bool = False, schedule: LearningRateSchedule | None = None,
    optimizer_in_backward: bool = False,
) -> TrainStep:
    """schedule: None = the first param group's rate, constant."""
    constant_rate = LearningRateSchedule("constant", float(optimizer.param_groups[0]["lr"]), warmup_updates=0, total_updates=1)
    return TrainStep(
        unet,
        optimizer,
        schedule or constant_rate,
        build_noise_scheduler(str(pipeline_dir), prediction_type, zero_terminal_snr=False),
        settings or NoiseSettings(conditional_dropout_percent=0.0),
        empty_prompt_for(unet),
        run_seed=3,
        max_grad_norm=max_grad_norm,
        ema=ema,
        reduce_every_microbatch=reduce_every_microbatch,
        gather_once_per_update=gather_once_per_update,
        optimizer_in_backward=optimizer_in_backward,
    )


def saved_state_of(step: TrainStep, optimizer_name: str, world_size: int) -> tuple[TrainerState, DataPosition]:
    """What the trainer would write beside the tensors after `step`'s updates (at the start of epoch 0)."""
    state = TrainerState(
        **step.state_dict(),
        epoch=0,
        updates_in_epoch=step.updates_done,
        seed=step.run_seed,
        optimizer=optimizer_name,
        use_ema=step.ema is not None,
        ema_updates=step.ema.updates if step.ema is not None else 0,
        world_size=world_size,
        global_batch_size=2 * world_size,
        gradient_accumulation_steps=1,
    )
    return state, DataPosition.epoch_start(0)


def trainer_state_for(**fields) -> TrainerState:
    """A TrainerState of a run 3 updates in (adamw8bit, 2 processes), with `fields` set."""
    return TrainerState(
        update=3, epoch=0, updates_in_epoch=3, seed=5, optimizer="adamw8bit", use_ema=False, ema_updates=0, world_size=2,
        global_batch_size=2, gradient_accumulation_steps=1, skipped_updates=0, consecutive_skipped_updates=0, loss_scaler=None, **fields,
    )


def clipping_against_torch(unet: torch.nn.Module, seed: int = 0, max_norms: tuple[float, ...] = (1.0, math.inf)) -> dict[str, dict[str, float]]:
    """Seeded gradients (large enough to be clipped at 1) on every parameter, clipped by clip_gradients and
    by torch.nn.utils.clip_grad_norm_: per max_norm, both norms and the largest difference of the results."""
    parameters = list(unet.parameters())
    generator = torch.Generator().manual_seed(seed)
    originals = []
    for parameter in parameters:
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        values = torch.randn(local.shape, generator=generator, dtype=local.dtype)
        originals.append(values)
    report = {}
    for max_norm in max_norms:
        clipped = {}
        for name, clip in (("ours", clip_gradients), ("torch", torch.nn.utils.clip_grad_norm_)):
            for parameter, values in zip(parameters, originals):
                local = values.clone()
                parameter.grad = DTensor.from_local(local, parameter.device_mesh, parameter.placements) if isinstance(parameter, DTensor) else local
            norm = clip(parameters, max_norm)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            local_grads = [parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad for parameter in parameters]
            clipped[name] = (norm.item(), local_grads)
        (ours_norm, ours), (torch_norm, theirs) = clipped["ours"], clipped["torch"]
        report[str(max_norm)] = {
            "ours": ours_norm, "torch": torch_norm,
            "gradient_difference": max((mine - reference).abs().max().item() for mine, reference in zip(ours, theirs)),
        }
    for parameter in parameters:
        parameter.grad = None
    return report


def assert_clipped_as_torch(report: dict[str, dict[str, float]]) -> None:
    """clipping_against_torch's report: the same norm and gradients, and the seeded gradients were clipped."""
    for max_norm, result in report.items():
        assert math.isclose(result["ours"], result["torch"], rel_tol=1e-6), (max_norm, result)
        assert result["gradient_difference"] <= 1e-7, max_norm
    assert report["1.0"]["torch"] > 10


def save_training_state(checkpoint_dir: Path, model, optimizer, ema, trainer_state: TrainerState, position: DataPosition,
                        writer_factory=JsonIndexWriter) -> Path:
    """Collective: the state saved at once, as the trainer's Checkpointer saves it (staged, then written)."""
    staged = stage_training_state(model, optimizer, ema, trainer_state, position, TensorStager())
    return write_staged_state(checkpoint_dir, staged, writer_factory=writer_factory)


def save_training_state_by_writer_process(checkpoint_dir: Path, model, optimizer, ema, trainer_state: TrainerState, position: DataPosition) -> Path:
    """Collective: the state saved as a background save writes it, by a writer process (state/writer_process.py)."""
    stager = TensorStager()
    staged = stage_training_state(model, optimizer, ema, trainer_state, position, stager)
    writer = WriterProcess.start(dist.new_group(backend="gloo"))
    try:
        writer.send(save_request(checkpoint_dir, staged, stager.buffer, JsonIndexWriter))
        reply = writer.reply()
    finally:
        writer.close()
    if set(reply) != {"seconds"}:
        raise AssertionError(f"the writer process did not save: {reply}")
    return checkpoint_dir


# Rates for the tiny UNet's 13 blocks (kohya's split): 1-4 x 1e-3, block 3 (its first downsampler) and 12 (the
# output layers) frozen.
TINY_BLOCK_RATES = [0.0 if block in (3, 12) else 1e-3 * (1 + block % 4) for block in range(13)]


def assert_each_block_moved_by_its_rate(changes: list[float], rates: list[float]) -> None:
    """largest_change_per_block's result: AdamW's first update moves a block's weights by its rate (to the
    rounding of the weights), a frozen block's not at all."""
    for block, (rate, change) in enumerate(zip(rates, changes, strict=True)):
        if rate == 0:
            assert change == 0.0, f"block {block} is frozen, yet moved by {change}"
        else:
            assert abs(change / rate - 1) < 1e-3, f"block {block}: moved by {change} at rate {rate}"


def largest_change_per_block(unet, pipeline_dir: Path, block_rates: list[float], batch: dict[str, torch.Tensor], learning_rate: float = 1e-3) -> list[float]:
    """One AdamW update (no weight decay) of `unet`, prepared for training with the blocks at rate 0 frozen
    first, with one param group per kohya block at its rate (TrainedModels.parameter_groups, as the trainer
    builds them for --block_lr) under a schedule whose peak is `learning_rate`: the largest change of a weight
    in each block. AdamW's first update moves each weight by its rate times |g| / (|g| + eps)."""
    from sdxl_trainer.optimizers.build import build_optimizer
    from sdxl_trainer.training.block_rates import unet_blocks
    from sdxl_trainer.training.trained_models import TrainedModels

    def whole(parameter: torch.Tensor) -> torch.Tensor:
        return (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()).clone()

    groups = TrainedModels(unet).parameter_groups(learning_rate, {}, block_rates)
    optimizer = build_optimizer("adamw", groups, learning_rate, 0.0, (0.9, None), 1e-8)
    step = make_train_step(unet, optimizer, pipeline_dir, schedule=LearningRateSchedule("constant", learning_rate, warmup_updates=0, total_updates=1))
    blocks = unet_blocks(unet)
    before = [[whole(parameter) for parameter in block] for block in blocks]
    step([batch], epoch=0)
    return [max((whole(parameter) - start).abs().max().item() for parameter, start in zip(block, starts)) for block, starts in zip(blocks, before)]
