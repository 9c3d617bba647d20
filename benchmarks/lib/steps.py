"""The two steps the benchmarks compare, over the same model, batch and optimizer:
- the trainer's update, built the trainer's way: TrainStep over the UNet as prepare_unet leaves it (several
  processes or --cpu_offload: FSDP2, compute in the compute dtype over fp32 master shards, fp32 gradient
  reduction; one process: a plain module under torch.autocast) with build_optimizer's optimizer: per-sample
  seeded noise, timesteps and caption dropout, the loss all-reduce, clipping, the NaN/inf check, the optimizer
  and LR steps. Optionally it also reads each update's batch as the trainer does (the DataStream over a cache,
  its DataLoader workers drawing each sample's noise) and logs it as the trainer does (TrainingMonitor: every
  rank's peak memory gathered, TensorBoard scalars): sdxl_FSDP_train.py's loop less checkpoints and validation.
- the plain loop: what a minimal PyTorch loop writes, noise and timesteps from the device's RNG, MSE to the
  noise, backward, clip_grad_norm_, the same optimizer; over a plain nn.Module under torch.autocast ("plain",
  one process), or over the same FSDP2 sharding as the trainer's ("fsdp2", where a plain module would not be
  sharded and could not be compared). Its batch stays on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torchao.optim import AdamW8bit as TorchaoAdamW8bit

from benchmarks.lib.timing import Step
from benchmarks.lib.unets import SEED, empty_prompt, new_batch, new_unet, noise_scheduler
from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.fsdp import compile_repeated_blocks, prepare_unet, shard_unet
from sdxl_trainer.distributed.world import World
from sdxl_trainer.jobs.train_config import TrainConfig
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter
from sdxl_trainer.monitoring.monitor import TrainingMonitor
from sdxl_trainer.monitoring.throughput import Throughput
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer
from sdxl_trainer.training.lr_schedule import LearningRateSchedule
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import SampleDraws
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.stream import DataPosition
from sdxl_trainer.training.training_data import load_training_data

TORCHAO_ADAMW8BIT = "torchao_adamw8bit"  # torchao's own AdamW8bit, which steps tensor by tensor, to compare the trainer's adamw8bit with
OPTIMIZER_CHOICES = (*OPTIMIZERS, TORCHAO_ADAMW8BIT)
NOISE_SETTINGS = NoiseSettings(conditional_dropout_percent=0.1)
LEARNING_RATE = 1e-5


@dataclass(frozen=True)
class StepSettings:
    """What one measured configuration trains, the same in both paths."""

    model: str = "sdxl"  # unets.UNET_BUILDERS' key
    resolution: int = 1024  # square image side in px; latents are resolution / 8 per side
    batch_size: int = 1  # images per process per update
    gradient_checkpointing: bool = True  # recompute activations in backward
    optimizer: str = "adamw8bit"  # build_optimizer's name, or TORCHAO_ADAMW8BIT
    weights_dtype: str = "fp32"  # the trainer's --weights_dtype: fp32 master weights, or bf16 weights with stochastic rounding
    compute_dtype: torch.dtype = torch.float32  # the dtype the forward and backward compute in (the trainer's resolved --mixed_precision)
    compile: bool = False  # regional torch.compile of each transformer and ResNet block (compile_repeated_blocks)
    recompile_limit: int | None = None  # with compile: Dynamo's graphs per compiled forward; None = as compile_repeated_blocks sets it
    cpu_offload: bool = False  # the trainer's --cpu_offload (the trainer path only)
    reduce_dtype: torch.dtype = torch.float32  # the trainer's --reduce_dtype: what FSDP2 reduce-scatters gradients in (the trainer path only)

    def with_row(self, batch_size: int, gradient_checkpointing: bool) -> StepSettings:
        return dataclasses.replace(self, batch_size=batch_size, gradient_checkpointing=gradient_checkpointing)


@dataclass
class BuiltPath:
    """A path ready to run: its model, its step (update number -> result) and, when it reads its data as the
    trainer does, the monitor that logs each update (its throughput holds the time spent waiting for data)."""

    model: torch.nn.Module
    step: Step
    monitor: TrainingMonitor | None = None
    train_step: TrainStep | None = None  # the trainer's path: its TrainStep (optimizer, counters), for what saves its state

    @property
    def throughput(self) -> Throughput | None:
        return self.monitor.throughput if self.monitor is not None else None

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def param_dtype(compute_dtype: torch.dtype) -> torch.dtype | None:
    """FSDP2's parameter dtype for a compute dtype: None keeps the fp32 weights."""
    return None if compute_dtype == torch.float32 else compute_dtype


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    if name == TORCHAO_ADAMW8BIT:
        return TorchaoAdamW8bit(parameters, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    return build_optimizer(name, parameters, LEARNING_RATE, 1e-2, (0.9, 0.999), 1e-8)


def loss_scaler(settings: StepSettings, world: World) -> ShardedGradScaler | None:
    """fp16 needs loss scaling; the sharded scaler also serves plain parameters."""
    return ShardedGradScaler(world.device.type) if settings.compute_dtype == torch.float16 else None


def reference_loss(unet: torch.nn.Module, batch: dict[str, torch.Tensor], scheduler: DDPMScheduler) -> torch.Tensor:
    """The objective as a minimal loop writes it: noise and timesteps from the device's RNG, MSE to the noise."""
    latents = batch["latents"]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    prediction = unet(
        scheduler.add_noise(latents, noise, timesteps),
        timesteps,
        encoder_hidden_states=batch["prompt_embeds"],
        added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"], "time_ids": batch["time_ids"]},
    ).sample
    return F.mse_loss(prediction.float(), noise)


def build_trainer(settings: StepSettings, world: World, cache_dir: Path | None = None) -> BuiltPath:
    """The UNet as the trainer prepares it and TrainStep over it. Without `cache_dir`, every update trains on one
    synthetic batch kept on the device; with it (a cache holding enough items for every update,
    synthetic_cache.write_cache_for_unet), each update is read and logged as the trainer does (module docstring),
    its run folder (TensorBoard, the held-out items) beside the cache."""
    unet = prepare_unet(
        new_unet(settings.model, settings.weights_dtype, settings.gradient_checkpointing, world.device), world, param_dtype(settings.compute_dtype),
        compile_blocks=settings.compile, cpu_offload=settings.cpu_offload, reduce_dtype=settings.reduce_dtype,
    )  # fmt: skip
    if settings.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = settings.recompile_limit
    train_step = TrainStep(
        unet,
        make_optimizer(settings.optimizer, unet.parameters()),
        LearningRateSchedule("constant", LEARNING_RATE, warmup_updates=0, total_updates=1),
        noise_scheduler(),
        NOISE_SETTINGS,
        empty_prompt(unet, world.device),
        SEED,
        max_grad_norm=1.0,
        scaler=loss_scaler(settings, world),
    )
    if cache_dir is None:
        batch = new_batch(unet, settings.resolution, settings.batch_size, world.device, world.rank)
        return BuiltPath(unet, lambda index: train_step([batch], epoch=index), train_step=train_step)
    return _reading_like_the_trainer(unet, train_step, settings, world, cache_dir)


def _reading_like_the_trainer(unet: UNet2DConditionModel, train_step: TrainStep, settings: StepSettings, world: World, cache_dir: Path) -> BuiltPath:
    """TrainStep fed and logged as sdxl_FSDP_train.py's loop feeds and logs it: the data options from the trainer's
    own flags (no validation split: nothing is held out), its data stream, its monitor."""
    config = parse_config(TrainConfig, ["--cached_dataset_dirs", str(cache_dir), "--train_batch_size", str(settings.batch_size),
                                        "--no-validation_loss", "--no-validation_image"])  # fmt: skip
    run_dir = cache_dir.parent / "run"
    data = load_training_data(config.data_settings(), run_dir, SEED, world.world_size, world.is_main)
    stream = data.stream(DataPosition.epoch_start(0), 0, world.rank, world.device, draws=SampleDraws(SEED, NOISE_SETTINGS))
    host_group = dist.new_group(backend="gloo")  # as the trainer's: the monitor's gathers on CPU tensors
    # No progress bar (is_main False): its redraws would run through the printed table.
    monitor = TrainingMonitor(MetricsWriter(run_dir / "tensorboard", world.is_main), stream.num_updates, 0, world.device, is_main=False,
                              host_group=host_group, every_n_updates=config.log_every_n_updates)
    updates = iter(stream)

    def step(index: int) -> object:
        monitor.throughput.start()
        update = next(updates)
        monitor.throughput.data_ready()
        result = train_step(update.microbatches, update.epoch)
        monitor.throughput.stop(update.images)
        monitor.log_update(index + 1, update.epoch, result)
        return result

    return BuiltPath(unet, step, monitor)


def build_plain_loop(settings: StepSettings, world: World, sharded: bool) -> BuiltPath:
    """The minimal loop (module docstring): a plain module under torch.autocast, or `sharded` over the trainer's FSDP2
    sharding (whose policy then does the casting)."""
    unet = new_unet(settings.model, settings.weights_dtype, settings.gradient_checkpointing, world.device)
    if sharded:
        shard_unet(unet, world.mesh, param_dtype(settings.compute_dtype), compile_blocks=settings.compile)
    elif settings.compile:
        compile_repeated_blocks(unet)
    optimizer = make_optimizer(settings.optimizer, unet.parameters())
    scaler = loss_scaler(settings, world)
    autocast = not sharded and settings.compute_dtype != torch.float32
    scheduler = noise_scheduler()
    batch = new_batch(unet, settings.resolution, settings.batch_size, world.device, world.rank)

    def step(index: int) -> None:
        with torch.autocast(world.device.type, dtype=settings.compute_dtype, enabled=autocast):
            loss = reference_loss(unet, batch, scheduler)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return BuiltPath(unet, step)
