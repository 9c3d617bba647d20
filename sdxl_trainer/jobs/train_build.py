"""A training run built from its configuration: everything checked before anything loads, then data,
models, optimizer, train step, logging, evaluator, checkpointer and exporter, each by its owner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from sdxl_trainer.cache.compatibility import CacheCheck
from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.config import config_to_dict, write_resolved_config
from sdxl_trainer.distributed.fsdp import prepare_text_encoder, prepare_unet, uses_sharding
from sdxl_trainer.distributed.stop_request import StopRequest
from sdxl_trainer.distributed.world import World, broadcast_text
from sdxl_trainer.evaluation.evaluator import SAMPLE_GRID_FILE, Evaluator, PipelineSource, build_evaluator
from sdxl_trainer.evaluation.metrics import MetricWeightsError
from sdxl_trainer.jobs.train_config import (
    DTYPE_OF_NAME,
    TrainConfig,
    device_memory_gib,
    learning_rate_schedule,
    reduce_every_microbatch,
    resolve_compute_dtype,
    with_cache_settings,
)
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES, text_encoder_label
from sdxl_trainer.models.encoders import load_text_encoders
from sdxl_trainer.models.single_file import config_source, load_unet
from sdxl_trainer.models.weight_files import ModelFilesError, read_configs
from sdxl_trainer.optimizers.build import build_optimizer, evaluation_weights_of
from sdxl_trainer.outputs.export import Exporter, ExportError
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter, WANDB_ID_FILE, WandbSettings
from sdxl_trainer.monitoring.monitor import TrainingMonitor
from sdxl_trainer.runtime.garbage_collection import CollectBetweenUpdates, exempt_live_objects_from_garbage_collection
from sdxl_trainer.runtime.quiet_libraries import hide_library_progress_bars
from sdxl_trainer.state.checkpoint_layout import CheckpointError
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.state.rng_states import seed_global_generators
from sdxl_trainer.state.trainer_state import DatasetIdentity, read_trainer_state, TrainerState
from sdxl_trainer.state.checkpointer import (
    Checkpointer,
    changed_dataset_problem,
    find_resume_checkpoint,
    no_checkpoint_reason,
    prepare_checkpoints_dir,
    resume_problems,
)
from sdxl_trainer.state.run_folder import RunFolderBusy, RunFolderLock, continues_run, earlier_exports, earlier_run_problems, start_over
from sdxl_trainer.training.block_rates import block_count_problem, freeze_zero_rate_blocks
from sdxl_trainer.training.captions import StepCaptionEncoder
from sdxl_trainer.training.dataset import CachedDataset
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.holdout import HoldoutError
from sdxl_trainer.training.loss import build_noise_scheduler
from sdxl_trainer.training.sample_draws import DrawsInTurn, SampleDraws
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.stream import DataPosition, DataStream
from sdxl_trainer.training.training_data import load_training_data, TrainingData
from sdxl_trainer.training.trained_models import TrainedModels


def agree_on_seed(seed: int | None, device: torch.device) -> int:
    """Use --set_seed, or draw one on rank 0 and share it so every rank plans the same epochs."""
    chosen = torch.tensor([seed if seed is not None else random.randrange(2**31)], dtype=torch.int64, device=device)
    dist.broadcast(chosen, src=0)
    return int(chosen.item())


def check_before_start(config: TrainConfig, run_dir: Path, world: World) -> tuple[TrainConfig, CacheCheck, Path | None, TrainerState | None]:
    """Model, caches and the checkpoint to resume from, all checked before anything loads; every problem
    is reported at once. Returns the run's config (with_cache_settings), the cache check, the checkpoint
    folder and its trainer state (None, None for a fresh start)."""
    config, caches = with_cache_settings(config)
    problems = list(caches.problems)
    resume_dir, checkpoint_problems = find_resume_checkpoint(config.load_saved_state, run_dir / "checkpoints", world.is_main)
    problems += checkpoint_problems
    # Whatever --load_saved_state says, a start that does not continue this folder's run would replace its results
    # ('latest' with every checkpoint damaged is refused above, naming them).
    if not config.overwrite_run and not (config.load_saved_state == "latest" and checkpoint_problems):
        problems += earlier_run_problems(run_dir, config.load_saved_state, resume_dir)
    if config.overwrite_run and continues_run(run_dir, resume_dir):
        problems.append(
            f"--overwrite_run would delete {run_dir / 'checkpoints'}, which holds {resume_dir}, the checkpoint --load_saved_state names: to go "
            "back to it, drop --overwrite_run (the later checkpoints are set aside, nothing is deleted)"
        )
    if config.block_lr is not None and not caches.problems:  # with the model found (else the cache check says where it is missing)
        problems += block_rate_problems(config)
    saved = None
    if resume_dir is not None and not checkpoint_problems:
        try:
            saved = read_trainer_state(resume_dir)
            problems += resume_problems(saved, config.run_facts(world.world_size), config.set_seed)
        except CheckpointError as error:
            problems.append(str(error))
    if problems:
        raise SystemExit("Cannot start training:\n  " + "\n  ".join(problems))
    return config, caches, resume_dir, saved


def block_rate_problems(config: TrainConfig) -> list[str]:
    """--block_lr against the blocks of the model's UNet, read from its config alone."""
    try:
        unet_config = read_configs(config_source(config.pretrained_model_name_or_path, config.single_file_config))[0]["unet"]
    except ModelFilesError as error:
        return [str(error)]
    problem = block_count_problem(config.block_lr, unet_config)
    return [problem] if problem else []


EXPECTED_ERRORS = (CacheError, CheckpointError, ExportError, HoldoutError, MetricWeightsError)  # their messages say it all


@contextlib.contextmanager
def hold_run_folder(run_dir: Path, world: World) -> Iterator[None]:
    """Rank 0 locks the run folder for the run's life; a second run into the same folder is refused on every
    rank before any work, naming the process that holds it."""
    lock, busy = None, ""
    if world.is_main:
        try:
            lock = RunFolderLock(run_dir)
        except RunFolderBusy as error:
            busy = str(error)
    busy = broadcast_text(busy, world.device)
    if busy:
        raise SystemExit(f"Cannot start training: {busy}")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


@dataclass(kw_only=True)
class Run:
    """Everything a run's loop uses, built by build_run."""

    config: TrainConfig
    world: World
    log_dir: Path
    models: TrainedModels
    ema: ShardedEMA | None
    stream: DataStream
    train_step: TrainStep
    first_update: int
    total_updates: int
    resumed: bool
    monitor: TrainingMonitor
    evaluator: Evaluator
    checkpointer: Checkpointer
    exporter: Exporter
    stop: StopRequest
    garbage: CollectBetweenUpdates

    def close(self) -> None:
        """After the loop, also when it failed: the logs flushed and closed, the stop signals and Python's
        automatic garbage collection given back."""
        self.monitor.close()
        self.stop.restore_handlers()
        self.garbage.close()


def loss_scaler(world: World, cpu_offload: bool) -> torch.amp.GradScaler:
    """fp16's loss scaler. Under FSDP2 the sharded one, which agrees across the ranks on whether a step overflowed
    (and takes gradients offloaded to the host); one plain module's needs no agreement, and torch's own scaler
    makes no collective where the sharded one all-reduces its verdict on every update."""
    if uses_sharding(world.world_size, cpu_offload):
        return ShardedGradScaler(world.device.type)
    return torch.amp.GradScaler(world.device.type)


def build_run(config: TrainConfig, world: World, stop: StopRequest) -> Run:
    """Check everything, then build the run from its parts: data, models, optimizer, train step, logging,
    evaluator, checkpointer and exporter, each by its owner. `stop`: the stop signals' handler, installed
    before the start-up (which a signal ends at once); from the end of the build on, a signal stops gracefully."""
    run_dir = config.output_dir / config.project_name
    config, caches, resume_dir, saved = check_before_start(config, run_dir, world)
    # Only now the model libraries load (diffusers, transformers: seconds of CPU), which a refused start never waits for.
    hide_library_progress_bars()
    log_dir = config.log_dir or run_dir / "tensorboard"
    if world.is_main:
        if config.overwrite_run:
            for message in start_over(run_dir, earlier_results(run_dir, log_dir), config.delete_abandoned_branches):
                print(message)
        prepare_checkpoints_dir(run_dir / "checkpoints", saved.update if saved else None)
    seed = agree_on_seed(saved.seed if saved else config.set_seed, world.device)
    seed_global_generators(seed + world.rank)  # a resume then restores the checkpoint's states over these
    compute_dtype = resolve_compute_dtype(config.mixed_precision, world.device, config.weights_dtype)

    data = load_training_data(config.data_settings(), run_dir, seed, world.world_size, world.is_main)
    if saved is not None:
        changed = changed_dataset_problem(resume_dir, saved, data.identity, config.accept_changed_dataset)
        if changed:
            raise SystemExit(f"Cannot start training: {changed}")
    empty_prompt = tuple(tensor.to(world.device) for tensor in caches.empty_prompt)  # read and checked by check_before_start
    models, caption_encoder = build_models(config, world, data.dataset, seed, compute_dtype, caches.caption_chunks)
    exempt_live_objects_from_garbage_collection()  # the model libraries' objects too, imported by now
    scaler = loss_scaler(world, config.cpu_offload) if compute_dtype == torch.float16 else None
    if scaler is not None and config.optimizer_in_backward:
        raise SystemExit(
            "Cannot start training: this GPU has no bf16, so --mixed_precision auto computes in fp16, whose loss scaling "
            "--optimizer_in_backward cannot take (the scaler checks every gradient before any step): drop --optimizer_in_backward"
        )
    groups = models.parameter_groups(config.learning_rate, config.text_encoder_rates(), config.block_lr)
    optimizer = build_optimizer(
        config.optimizer, groups, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon,
        came_beta3=config.came_beta3, prodigy=config.prodigy_settings(),
    )
    # Validation, samples, exports and the EMA see the optimizer's evaluation weights where it keeps them apart (schedule-free).
    models.evaluate_with(evaluation_weights_of(optimizer))
    ema = ShardedEMA(models.unet, config.ema_decay, on_cpu=config.ema_on_cpu, evaluation_weights=models.evaluation_weights) if config.use_ema else None
    position = resume(config, world, resume_dir, saved, models, optimizer, ema, run_dir, data.identity)
    first_update = saved.update if saved else 0
    draws = SampleDraws(seed, config.noise_settings())
    # Caption mode's captions are varied and tokenized where the batch is read, as the noise is drawn.
    stream = data.stream(position, first_update, world.rank, world.device, draws=DrawsInTurn((draws, caption_encoder.draws)) if caption_encoder else draws)
    total_updates = first_update + stream.num_updates
    if total_updates == 0:
        raise SystemExit(
            f"No optimizer update is possible: {len(data.dataset)} items, global batch {data.global_batch_size} x "
            f"{config.gradient_accumulation_steps} accumulation steps. Lower --train_batch_size or --gradient_accumulation_steps."
        )
    noise_scheduler = build_noise_scheduler(
        config_source(config.pretrained_model_name_or_path, config.single_file_config), config.prediction_type, config.zero_terminal_snr
    )
    train_step = TrainStep(
        models.unet, optimizer, learning_rate_schedule(config, total_updates), noise_scheduler, config.noise_settings(), empty_prompt, seed,
        config.max_grad_norm,
        scaler=scaler,
        ema=ema,
        reduce_every_microbatch=reduce_every_microbatch(config, device_memory_gib(world.device)),
        caption_encoder=caption_encoder,
        gather_once_per_update=not config.reshard_after_forward,
        optimizer_in_backward=config.optimizer_in_backward,
    )
    if saved:
        train_step.load_state_dict(dataclasses.asdict(saved))
    if world.is_main:
        write_resolved_config(dataclasses.replace(config, set_seed=seed), run_dir / "config.json")  # the seed drawn or resumed, to repeat the run
        describe_run(config, world, data, stream, total_updates, compute_dtype, train_step.reduce_every_microbatch)

    wandb_settings = WandbSettings(config.wandb_project, config.project_name, run_dir, config_to_dict(config)) if config.report_to_wandb else None
    host_group = dist.new_group(backend="gloo")  # the monitor's gathers and the stop agreement, on CPU tensors
    monitor = TrainingMonitor(MetricsWriter(log_dir, world.is_main, wandb_settings), total_updates, first_update, world.device, world.is_main, host_group,
                              config.log_every_n_updates)
    pipeline_source = PipelineSource(
        config.pretrained_model_name_or_path, config.single_file_config, compute_dtype, config.sampling_scheduler_overrides(), config.handoff_dir,
        config.project_name, caches.vae_name_or_path,
    )
    evaluator = build_evaluator(
        config.evaluation_settings(), world, run_dir, data.dataset, data.holdout, noise_scheduler, empty_prompt, pipeline_source, seed, caches.caption_chunks,
        caption_encoder if config.train_text_encoder else None,
    )
    checkpointer = Checkpointer(
        run_dir / "checkpoints", config, models.checkpointed, optimizer, ema, train_step, config.run_facts(world.world_size), seed, report=monitor.say,
        last_saved_update=first_update if saved else None, dataset=data.identity,
    )
    exporter = Exporter(config.export_settings(caches.vae_name_or_path), world, lambda: models.exported_weights_on_rank0(ema, world.is_main),
                        ema is not None, run_dir)
    stop.training_begins()
    return Run(
        config=config, world=world, log_dir=log_dir, models=models, ema=ema, stream=stream, train_step=train_step, first_update=first_update,
        total_updates=total_updates, resumed=saved is not None, monitor=monitor, evaluator=evaluator, checkpointer=checkpointer, exporter=exporter,
        stop=stop, garbage=CollectBetweenUpdates(config.gc_every_n_updates),
    )


def earlier_results(run_dir: Path, log_dir: Path) -> list[Path]:
    """What --overwrite_run moves aside so the folder shows one run: the exports, TensorBoard event files,
    sample grid and W&B run id (a new run id: W&B would otherwise continue the earlier run's curves)."""
    events = sorted(log_dir.glob("events.out.tfevents.*")) if log_dir.is_dir() else []
    return [*earlier_exports(run_dir), *events, run_dir / SAMPLE_GRID_FILE.parent, run_dir / WANDB_ID_FILE]


def build_models(config: TrainConfig, world: World, dataset: CachedDataset, seed: int, compute_dtype: torch.dtype,
                 caption_chunks: int) -> tuple[TrainedModels, StepCaptionEncoder | None]:
    """The trained models, sharded and on the device, and in caption mode the encoder of every step's captions.
    Only the UNet is loaded (and the text encoders in caption mode): latents and caption embeddings come from
    the cache. Diffusers' default attention processor is PyTorch SDPA (flash / memory-efficient kernels
    where the GPU has them)."""
    if world.device.type == "cuda" and config.allow_tf32:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    weights_dtype = DTYPE_OF_NAME[config.weights_dtype]
    unet = load_unet(config.pretrained_model_name_or_path, config.single_file_config, weights_dtype)
    freeze_zero_rate_blocks(unet, config.block_lr)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.to(world.device).train()
    param_dtype = None if compute_dtype == torch.float32 else compute_dtype
    reduce_dtype = DTYPE_OF_NAME[config.reduce_dtype]
    prepare_unet(unet, world, param_dtype, config.reshard_after_forward, compile_blocks=config.compile_unet, cpu_offload=config.cpu_offload,
                 reduce_dtype=reduce_dtype)
    if not config.encode_captions_each_step:
        return TrainedModels(unet, {}), None
    # Frozen encoders compute in compute_dtype; trained ones keep master weights in --weights_dtype, sharded like the UNet.
    rates = config.text_encoder_rates()
    tokenizers, text_encoders = load_text_encoders(
        config.pretrained_model_name_or_path, world.device, compute_dtype, config.single_file_config,
        trained=tuple(name in rates for name in TEXT_ENCODER_NAMES), checkpointed=config.gradient_checkpointing, trained_dtype=weights_dtype,
    )
    trained = {name: encoder for name, encoder in zip(TEXT_ENCODER_NAMES, text_encoders) if name in rates}
    for encoder in trained.values():
        prepare_text_encoder(encoder, world, param_dtype, config.reshard_after_forward, cpu_offload=config.cpu_offload, reduce_dtype=reduce_dtype)
    variations = config.caption_variations()
    caption_encoder = StepCaptionEncoder(
        (tokenizers, text_encoders), dataset.caption_texts, lambda item: variations[dataset.cache_index[item]], seed, caption_chunks, world.device,
        trains=config.train_text_encoder, framing=dataset.framed,
    )
    return TrainedModels(unet, trained), caption_encoder


def resume(config: TrainConfig, world: World, resume_dir: Path | None, saved: TrainerState | None, models: TrainedModels,
           optimizer: torch.optim.Optimizer, ema: ShardedEMA | None, run_dir: Path, dataset: DatasetIdentity) -> DataPosition:
    """Collective: load the checkpoint's state into the models, optimizer and EMA; returns where the data
    stands (the first epoch's start for a fresh run). DCP reshards on load, so the checkpoint may come from
    another number of processes. On data other than the checkpoint's (`dataset`; accepted by
    --accept_changed_dataset, else refused before), the checkpoint's epoch starts over: its position names items
    by their place in the old data."""
    if resume_dir is None:
        if world.is_main and config.load_saved_state == "latest":
            print(f"No checkpoint in {run_dir / 'checkpoints'} ({no_checkpoint_reason(run_dir / 'checkpoints')}): starting from the base model.")
        return DataPosition.epoch_start(0)
    started = time.perf_counter()
    _, position_state = load_training_state(resume_dir, models.checkpointed, optimizer, ema)
    position = DataPosition.from_state_dict(position_state)
    if world.is_main:
        print(
            f"Resumed from {resume_dir} in {time.perf_counter() - started:.1f} s: update {saved.update}, epoch {position.epoch + 1} "
            f"after {position.updates_in_epoch} of its updates (saved on {saved.world_size} processes, now {world.world_size})."
        )
    if saved.dataset is None:
        if world.is_main:
            print(f"{resume_dir} was saved before checkpoints recorded their data: a resume on other data cannot be told apart.")
        return position
    changes = saved.dataset.changes(dataset)
    if changes:
        position = DataPosition.epoch_start(position.epoch)
        if world.is_main:
            print(
                f"--accept_changed_dataset: the data changed since {resume_dir} ({changes}), so epoch "
                f"{position.epoch + 1} starts over on it; the update count and the learning-rate schedule go on from update {saved.update}."
            )
    return position


def describe_run(config: TrainConfig, world: World, data: TrainingData, stream: DataStream, total_updates: int, compute_dtype: torch.dtype,
                 reduces_every_microbatch: bool) -> None:
    """The run in a few lines (rank 0): data, processes, length, precision, sharding, caption mode."""
    global_batch_size = data.global_batch_size
    print(
        f"{len(data.dataset)} cached items"
        + (f" ({len(data.planner.epoch_samples(0))} samples an epoch with --dataset_repeats)" if any(record.repeats != 1 for record in config.dataset_records()) else "")
        + f", {world.world_size} process{'es' if world.world_size > 1 else ''}, {run_length(config, stream.num_epochs)}, "
        f"{total_updates} optimizer updates of {global_batch_size * config.gradient_accumulation_steps} images, "
        f"compute {str(compute_dtype).removeprefix('torch.')}, "
        + ("bf16 weights (stochastic rounding), " if config.weights_dtype == "bf16" else "")
        + (
            "UNet sharded with FSDP2"
            + (f" within {config.replicate_groups} replicated groups of {world.world_size // config.replicate_groups} (HSDP)" if config.replicate_groups > 1 else "")
            + (", gradients reduced after every microbatch." if reduces_every_microbatch else ".")
            if uses_sharding(world.world_size, config.cpu_offload)
            else "one process: UNet not sharded" + (" (autocast)." if compute_dtype != torch.float32 else ".")
        )
    )
    if config.encode_captions_each_step:
        variations = config.caption_variations()
        described = (
            variations[0].describe() if len(set(variations)) == 1
            else "; ".join(f"{cache_dir}: {variation.describe()}" for cache_dir, variation in zip(config.cache_dirs(), variations))
        )
        print(f"Caption mode: both text encoders encode every step's captions: {described}.")
    if config.block_lr is not None:
        frozen = f"; blocks {config.frozen_unet_blocks()} stay frozen (rate 0)" if config.frozen_unet_blocks() else ""
        rates = " ".join(f"{rate:g}" for rate in config.block_lr)
        print(f"UNet blocks 0-{len(config.block_lr) - 1} at their own peak learning rates (--block_lr): {rates}{frozen}.")
    if config.train_text_encoder:
        trained = [f"{text_encoder_label(name)} at {rate:g}" for name, rate in config.text_encoder_rates().items()]
        frozen = f"; {text_encoder_label(config.frozen_text_encoder())} stays frozen (rate 0)" if config.frozen_text_encoder() else ""
        print(f"Training {' and '.join(trained)} too (peak learning rates; the UNet's: {config.learning_rate:g}){frozen}.")


def run_length(config: TrainConfig, epochs_planned: int) -> str:
    if not config.max_train_updates:
        return f"{config.num_train_epochs} epochs"
    return f"until update {config.max_train_updates} (--max_train_updates; in {epochs_planned} epoch{'s' if epochs_planned != 1 else ''})"
