"""Full fine-tuning of the SDXL UNet from a latent cache, sharded with PyTorch FSDP2 over every process.

Launch with train.sh (torchrun, one process per GPU; 2 CPU processes without a GPU), or accelerate launch.
Reads caches written by sdxl_process_data_dir.py, so only the UNet is loaded: no VAE, no text encoders.
Reads top to bottom: configuration, set-up (world, data, model, optimizer), the training loop, export.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader
from tqdm import tqdm

from sdxl_trainer.buckets import BUCKET_TABLE_VERSION, categories
from sdxl_trainer.cache import CacheError, read_cache_info, read_empty_prompt, settings_differences
from sdxl_trainer.config import option, parse_config, write_resolved_config
from sdxl_trainer.data import CachedDataset, EpochPlanner, collate, rank_slice, small_buckets
from sdxl_trainer.diffusion import NoiseSettings, training_loss
from sdxl_trainer.export import save_pipeline
from sdxl_trainer.monitor import MetricsWriter, Throughput, gather_floats, peak_memory_gib
from sdxl_trainer.optimizers import build_optimizer
from sdxl_trainer.parallel import full_state_dict_on_rank0, init_distributed, shard_unet, shutdown_distributed

LR_SCHEDULERS = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]


@dataclass
class TrainConfig:
    cached_dataset_dirs: list[Path] = option(help="cache folders written by sdxl_process_data_dir.py (one or more)")
    pretrained_model_name_or_path: str = option(
        "stabilityai/stable-diffusion-xl-base-1.0", help="SDXL pipeline to fine-tune (hub id or local diffusers folder); must be the one the caches were made with"
    )
    output_dir: Path = option(Path("output"), help="runs are written to OUTPUT_DIR/PROJECT_NAME")
    project_name: str = option("sdxl_finetune", help="name of this run's folder inside --output_dir")
    log_dir: Path | None = option(None, help="TensorBoard folder; None = OUTPUT_DIR/PROJECT_NAME/tensorboard")
    min_resolution: int = option(512, help="smallest bucket category in px; must equal the caches'")
    max_resolution: int = option(1024, help="largest bucket category in px; must equal the caches'")
    train_batch_size: int = option(1, help="images per GPU per microbatch")
    gradient_accumulation_steps: int = option(1, help="microbatches per optimizer update; effective batch = train_batch_size x processes x this")
    num_train_epochs: int = option(10, help="passes over the training items")
    learning_rate: float = option(1e-5, help="peak learning rate")
    learning_rate_scheduler: LR_SCHEDULERS = option("constant_with_warmup", help="learning-rate schedule over optimizer updates")
    percent_lr_warm_up_steps: float = option(0.05, help="share (0-1) of all optimizer updates spent warming up linearly from 0")
    lr_num_cycles: int = option(1, help="hard restarts for cosine_with_restarts")
    polynomial_lr_end: float = option(1e-7, help="final learning rate of the polynomial schedule")
    polynomial_power: float = option(1.0, help="power of the polynomial schedule (1 = linear decay)")
    optimizer: Literal["adamw8bit", "adamw"] = option("adamw8bit", help="adamw8bit = torchao 8-bit AdamW (works on FSDP2 shards); adamw = torch AdamW, fp32 state")
    adam_beta1: float = option(0.9, help="AdamW beta1")
    adam_beta2: float = option(0.999, help="AdamW beta2")
    adam_epsilon: float = option(1e-8, help="AdamW epsilon")
    weight_decay: float = option(1e-2, help="AdamW decoupled weight decay")
    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this; 0 = no clipping (the norm is still logged)")
    conditional_dropout_percent: float = option(0.1, help="share (0-1) of samples trained with the empty caption, for classifier-free guidance")
    mixed_precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="UNet compute precision over fp32 master weights: auto = bf16 where the GPU supports it, else fp16; fp32 on CPU (bf16 is emulated there, about 5x slower)"
    )
    gradient_checkpointing: bool = option(True, help="recompute activations in backward: much less memory, about 30%% more compute")
    reshard_after_forward: bool = option(True, help="FSDP FULL_SHARD (True, least memory) or SHARD_GRAD_OP (False, faster, more memory)")
    set_seed: int | None = option(None, help="seed for data order, noise and dropout; None = a random seed, recorded in the run's config.json")
    dataloader_num_workers: int = option(2, help="background processes reading cache shards per rank; 0 = read in the training process")
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the exported diffusers pipeline")

    def validate(self) -> list[str]:
        problems = []
        try:
            categories(self.min_resolution, self.max_resolution)
        except ValueError as error:
            problems.append(str(error))
        for name in ("train_batch_size", "gradient_accumulation_steps", "num_train_epochs"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        for name in ("percent_lr_warm_up_steps", "conditional_dropout_percent"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"--{name} is a share between 0 and 1 (0.1 = 10%), got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            problems.append("--max_grad_norm must be >= 0 (0 turns clipping off)")
        return problems


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def check_caches(config: TrainConfig) -> list[str]:
    """Every cache must exist and match the trainer's resolution range and bucket table."""
    problems = []
    for cache_dir in config.cached_dataset_dirs:
        try:
            info = read_cache_info(cache_dir)
        except CacheError as error:
            problems.append(str(error))
            continue
        wanted = dict(min_resolution=config.min_resolution, max_resolution=config.max_resolution, bucket_table_version=BUCKET_TABLE_VERSION)
        differences = settings_differences(info, dataclasses.replace(info, **wanted), tuple(wanted))
        if differences:
            problems.append(f"{cache_dir} does not match this run ({'; '.join(differences)}): re-cache or change the flags")
    return problems


def build_lr_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, total_updates: int):
    """The schedule is a function of optimizer updates only (not microbatches, epochs or processes)."""
    warmup_updates = math.ceil(config.percent_lr_warm_up_steps * total_updates)
    if config.learning_rate_scheduler == "polynomial":
        return get_polynomial_decay_schedule_with_warmup(
            optimizer, warmup_updates, total_updates, lr_end=config.polynomial_lr_end, power=config.polynomial_power
        )
    return get_scheduler(
        config.learning_rate_scheduler,
        optimizer,
        num_warmup_steps=warmup_updates,
        num_training_steps=total_updates,
        num_cycles=config.lr_num_cycles,
    )


def agree_on_seed(seed: int | None, device: torch.device) -> int:
    """Use --set_seed, or draw one on rank 0 and share it so every rank plans the same epochs."""
    chosen = torch.tensor([seed if seed is not None else random.randrange(2**31)], dtype=torch.int64, device=device)
    dist.broadcast(chosen, src=0)
    return int(chosen.item())


def main(argv: list[str] | None = None) -> int:
    # ---- configuration -------------------------------------------------------------------------
    config = parse_config(TrainConfig, argv, description=__doc__)
    world = init_distributed()
    seed = agree_on_seed(config.set_seed, world.device)
    config.set_seed = seed
    torch.manual_seed(seed + world.rank)
    run_dir = config.output_dir / config.project_name
    log_dir = config.log_dir or run_dir / "tensorboard"
    compute_dtype = resolve_compute_dtype(config.mixed_precision, world.device)

    # ---- data: validate everything before loading the model --------------------------------------
    problems = check_caches(config)
    if problems:
        raise SystemExit("Cannot start training:\n  " + "\n  ".join(problems))
    dataset = CachedDataset(config.cached_dataset_dirs)
    global_batch_size = config.train_batch_size * world.world_size
    all_items = np.arange(len(dataset))
    bucket_ids = dataset.bucket_ids()
    too_small = small_buckets(dataset.bucket_sizes, bucket_ids, all_items, global_batch_size)
    if world.is_main and too_small:
        print(
            f"Warning: {sum(too_small.values())} items in buckets smaller than one global batch of {global_batch_size} "
            f"will not be trained on: {too_small}. Lower --train_batch_size or add images of those shapes to use them."
        )
    planner = EpochPlanner(bucket_ids, all_items, global_batch_size, config.gradient_accumulation_steps, seed)
    plans = planner.plans(config.num_train_epochs)
    total_updates = sum(len(plan.batches) for plan in plans) // config.gradient_accumulation_steps
    if total_updates == 0:
        raise SystemExit(
            f"No optimizer update is possible: {len(dataset)} items, global batch {global_batch_size} x "
            f"{config.gradient_accumulation_steps} accumulation steps. Lower --train_batch_size or --gradient_accumulation_steps."
        )
    empty_prompt = tuple(tensor.to(world.device) for tensor in read_empty_prompt(config.cached_dataset_dirs[0]))
    if world.is_main:
        write_resolved_config(config, run_dir / "config.json")
        print(
            f"{len(dataset)} cached items, {world.world_size} processes, {config.num_train_epochs} epochs, "
            f"{total_updates} optimizer updates of {global_batch_size * config.gradient_accumulation_steps} images, "
            f"compute {str(compute_dtype).removeprefix('torch.')}."
        )

    # ---- model, optimizer, schedules -------------------------------------------------------------
    unet = UNet2DConditionModel.from_pretrained(config.pretrained_model_name_or_path, subfolder="unet", torch_dtype=torch.float32)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.to(world.device).train()
    shard_unet(unet, world.mesh, None if compute_dtype == torch.float32 else compute_dtype, config.reshard_after_forward)
    noise_scheduler = DDPMScheduler.from_pretrained(config.pretrained_model_name_or_path, subfolder="scheduler")
    noise_settings = NoiseSettings(conditional_dropout_percent=config.conditional_dropout_percent)
    optimizer = build_optimizer(
        config.optimizer, unet.parameters(), config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    lr_scheduler = build_lr_scheduler(config, optimizer, total_updates)
    # fp16 needs loss scaling; the sharded scaler agrees across ranks on whether a step overflowed.
    scaler = ShardedGradScaler() if compute_dtype == torch.float16 else None
    metrics = MetricsWriter(log_dir, enabled=world.is_main)
    throughput = Throughput()
    progress = tqdm(total=total_updates, desc="training", unit="update", disable=not world.is_main, dynamic_ncols=True)

    # ---- training loop ---------------------------------------------------------------------------
    update = 0
    skipped_updates = 0
    for epoch, plan in enumerate(plans):
        loader = DataLoader(
            dataset,
            batch_sampler=[rank_slice(batch, world.rank, config.train_batch_size) for batch in plan.batches],
            num_workers=config.dataloader_num_workers,
            collate_fn=collate,
            pin_memory=world.device.type == "cuda",
        )
        batches = iter(loader)
        epoch_losses = []
        for _ in range(len(plan.batches) // config.gradient_accumulation_steps):
            throughput.start()
            loss_sum = torch.zeros((), device=world.device)
            for micro in range(config.gradient_accumulation_steps):
                batch = {key: value.to(world.device, non_blocking=True) for key, value in next(batches).items()}
                unet.set_requires_gradient_sync(micro == config.gradient_accumulation_steps - 1)
                loss = training_loss(unet, batch, noise_scheduler, empty_prompt, seed, epoch, noise_settings)
                loss = loss / config.gradient_accumulation_steps
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach()
            if scaler:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(unet.parameters(), config.max_grad_norm or float("inf"))
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if scaler:
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                stepped = scaler.get_scale() >= scale_before
            else:
                optimizer.step()
                stepped = True
            optimizer.zero_grad(set_to_none=True)
            if stepped:
                lr_scheduler.step()  # the schedule counts real updates only
            else:
                skipped_updates += 1
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            throughput.stop(global_batch_size * config.gradient_accumulation_steps)
            update += 1

            loss_value = loss_sum.item()
            epoch_losses.append(loss_value)
            memory = gather_floats(peak_memory_gib(world.device), world.device)
            metrics.scalars(
                {
                    "train/loss": loss_value,
                    "train/lr": lr_scheduler.get_last_lr()[0],
                    "train/grad_norm": grad_norm.item(),
                    "train/skipped_updates": skipped_updates,
                    "perf/images_per_s": throughput.images_per_second,
                    **{f"perf/peak_memory_gib/rank{rank}": value for rank, value in enumerate(memory)},
                },
                update,
            )
            progress.set_postfix(epoch=epoch, loss=f"{loss_value:.4f}", img_s=f"{throughput.images_per_second:.2f}")
            progress.update()
        if epoch_losses:
            metrics.scalars({"train/epoch_loss": sum(epoch_losses) / len(epoch_losses)}, epoch + 1)
    progress.close()

    # ---- export ----------------------------------------------------------------------------------
    state_dict = full_state_dict_on_rank0(unet)
    if world.is_main:
        started = time.perf_counter()
        pipeline_dir = save_pipeline(state_dict, config.pretrained_model_name_or_path, run_dir / "pipeline", config.save_precision)
        print(f"Saved the trained pipeline ({config.save_precision}) to {pipeline_dir} in {time.perf_counter() - started:.1f} s.")
        print(f"TensorBoard logs: {log_dir}   (view with: tensorboard --logdir {log_dir})")
    metrics.close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
