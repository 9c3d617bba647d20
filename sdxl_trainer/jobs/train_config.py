"""The trainer's configuration: every flag of sdxl_FSDP_train.py, its checks, and what each part of the run
is built from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from sdxl_trainer.cache.buckets import ResolutionOptions
from sdxl_trainer.cache.compatibility import CacheCheck, CacheRequirements, check_caches
from sdxl_trainer.cache.stores import is_remote
from sdxl_trainer.config import option
from sdxl_trainer.distributed.fsdp import ComputeOptions, uses_sharding
from sdxl_trainer.evaluation.evaluator import EvaluationOptions, EvaluationSettings, Schedule
from sdxl_trainer.evaluation.metrics import MetricWeights
from sdxl_trainer.evaluation.sampling import GenerationSettings
from sdxl_trainer.models.options import ModelOptions
from sdxl_trainer.monitoring.monitor import LoggingOptions
from sdxl_trainer.optimizers.build import IN_BACKWARD_REFUSED, PRODIGY_MIN_LEARNING_RATE, SCHEDULE_FREE_SCHEDULES, OptimizerOptions
from sdxl_trainer.outputs.export import ExportOptions, ExportSettings
from sdxl_trainer.state.checkpointer import CheckpointOptions, RunFacts
from sdxl_trainer.training.block_rates import BlockRateOptions
from sdxl_trainer.training.captions import CaptionOptions, CaptionVariation
from sdxl_trainer.training.data_options import DataOptions, DataSettings
from sdxl_trainer.training.ema import EMAOptions
from sdxl_trainer.training.holdout import SplitSettings
from sdxl_trainer.training.lr_schedule import LearningRateSchedule, ScheduleOptions
from sdxl_trainer.training.objective_options import ObjectiveOptions
from sdxl_trainer.training.step import StepOptions

if TYPE_CHECKING:
    from sdxl_trainer.estimates.fake_run import EstimateSettings
    from sdxl_trainer.estimates.speed_estimate import SpeedSettings


@dataclass(kw_only=True)
class RunOptions:
    """The run"""

    output_dir: Path = option(
        Path("output"),
        help="runs are written to OUTPUT_DIR/PROJECT_NAME, a local folder (the caches may be in object storage; docs/object_storage.md)",
        url_refusal="run folders in object storage are not supported yet (checkpoints, exports and logs are written as files); give a local "
        "--output_dir and copy the run folder to the bucket (aws s3 sync, rclone; docs/object_storage.md)",
    )
    project_name: str = option("sdxl_finetune", help="name of this run's folder inside --output_dir")
    set_seed: int | None = option(
        None,
        help="seed for data order, noise and dropout, and of every rank's torch, NumPy and Python global generators (seed + rank), "
        "0 to 2^63-1; None = a random seed, recorded in the run's config.json",
    )

    def problems(self) -> list[str]:
        if self.set_seed is not None and not 0 <= self.set_seed < 2**63:
            return [f"--set_seed must be from 0 to 2^63-1 (the data order's generators take no negative seed), got {self.set_seed}"]
        return []


@dataclass(kw_only=True)
class EstimateOptions:
    """Estimates instead of a run"""

    estimate_memory: bool = option(
        False,
        help="print this configuration's memory per GPU at full SDXL size, by category, and which cards (16/24/48/80 GB) it fits, "
        "then exit: the trainer's own code on fake tensors, no GPU, model download or cache needed (minutes on a CPU); "
        "square --max_resolution latents, 1024 px where it is not given",
    )
    estimate_gpus: int = option(0, help="GPUs (all machines together) --estimate_memory and --estimate_speed assume; 0 = this machine's GPUs, 1 without any")
    estimate_speed: bool = option(
        False,
        help="print this configuration's time per update and img/s on --estimate_gpus GPUs of the kind --gpu linked by --interconnect "
        "(with --replicate_groups: --gpu's own link inside each machine, --interconnect between them), the share of communication not "
        "hidden behind compute and what to change, and the gain over one GPU, then exit: no GPU needed (seconds on a CPU); "
        "compute from an H200's measured steps scaled by peak FLOP/s (docs/speed.md)",
    )
    gpu: Literal["h100", "h200", "a100", "4090", "3090"] = option("h100", help="with --estimate_speed: the GPU kind")
    interconnect: Literal["nvlink4", "nvlink3", "pcie4", "pcie4_x8", "pcie4_x4", "pcie5", "ib400", "eth100"] = option(
        "nvlink4",
        help="with --estimate_speed: the link between the GPUs that shard together (between machines with --replicate_groups); "
        "pcie4_x8 / pcie4_x4: the lanes a desktop board gives each of two cards",
    )

    def problems(self) -> list[str]:
        problems = ["--estimate_gpus must be >= 0 (0 = this machine's GPUs)"] if self.estimate_gpus < 0 else []
        if self.estimate_memory and self.estimate_speed:
            problems.append("--estimate_memory and --estimate_speed: give one of them")
        return problems


@dataclass(kw_only=True)
class TrainConfig(
    RunOptions, DataOptions, ModelOptions, ResolutionOptions, OptimizerOptions, BlockRateOptions, ScheduleOptions, ObjectiveOptions, CaptionOptions,
    StepOptions, EMAOptions, ComputeOptions, EvaluationOptions, CheckpointOptions, ExportOptions, LoggingOptions, EstimateOptions,
):
    """Every option of sdxl_FSDP_train.py. Each section is defined, and checks its own options, beside the component
    that uses them (DataOptions in training/data_options.py, ObjectiveOptions in training/objective_options.py, ...); this class
    adds the checks that span sections and says what each part of the run is built from."""

    # --help lists these first, a line each (the full reference by section follows).
    COMMON_OPTIONS: ClassVar[dict[str, str]] = {
        "cached_dataset_dirs": "the caches to train on: sdxl_process_data_dir.py's folders or s3:// prefixes",
        "output_dir": "where run folders are made: OUTPUT_DIR/PROJECT_NAME",
        "project_name": "this run's folder",
        "pretrained_model_name_or_path": "the model to fine-tune; unset = the one the caches were made with",
        "train_batch_size": "images per GPU per microbatch",
        "gradient_accumulation_steps": "microbatches per optimizer update",
        "learning_rate": "peak learning rate",
        "optimizer": "adamw8bit|adamw|adafactor|lion|came|prodigy|adamw_schedulefree",
        "num_train_epochs": "passes over the data",
        "max_train_updates": "or a number of optimizer updates instead (0 = off)",
        "save_model_every_n_epochs": "export the model (and save state) every N epochs; 0 = only at the end",
        "load_saved_state": "latest = go on where this run stopped; or a checkpoint folder",
        "estimate_memory": "print the memory per GPU this configuration needs, then exit (no GPU needed)",
    }

    def validate(self) -> list[str]:
        problems = [problem for section in type(self).__mro__ if "problems" in vars(section) for problem in vars(section)["problems"](self)]
        if (self.estimate_memory or self.estimate_speed) and self.replicate_groups >= 1 and self.estimate_gpus % self.replicate_groups:
            problems.append(f"--estimate_gpus {self.estimate_gpus} does not split into --replicate_groups {self.replicate_groups} equal groups")
        if self.estimate_speed and (self.cpu_offload or self.train_text_encoder):
            problems.append(
                "--estimate_speed covers the UNet trained on the GPUs: not --cpu_offload (the optimizer steps on the host's CPU, whose "
                "speed it does not know) nor --train_text_encoder; leave them out for an estimate of the rest"
            )
        if self.learning_rate == 0 and self.train_text_encoder:
            problems.append("the UNet always trains here: kohya's --learning_rate 0 (text encoders alone) is not supported; give the UNet a rate")
        if self.optimizer == "prodigy" and any(rate < PRODIGY_MIN_LEARNING_RATE for rate in self.text_encoder_rates().values()):
            problems.append(
                "--optimizer prodigy: --learning_rate_te1 / --learning_rate_te2 multiply its estimated step size as --learning_rate "
                f"does: pass about 1.0 (0 keeps an encoder frozen), got {self.learning_rate_te1} / {self.learning_rate_te2}"
            )
        if self.optimizer == "adamw_schedulefree" and self.learning_rate_scheduler not in SCHEDULE_FREE_SCHEDULES:
            problems.append(
                f"--optimizer adamw_schedulefree averages its weights instead of decaying the rate: use --learning_rate_scheduler "
                f"constant_with_warmup (or constant), got {self.learning_rate_scheduler}"
            )
        if self.optimizer_in_backward:
            problems += self._in_backward_problems()
        if self.learning_rate_scheduler == "polynomial" and self.polynomial_lr_end >= self.learning_rate:
            problems.append(f"--polynomial_lr_end ({self.polynomial_lr_end}) must be below --learning_rate ({self.learning_rate})")
        return problems + self._caption_variation_problems() + self._run_folder_problems()

    def _in_backward_problems(self) -> list[str]:
        """What --optimizer_in_backward cannot do (training/in_backward.py), one line each with the fix."""
        problems = []
        if self.max_grad_norm > 0:
            problems.append(
                f"--optimizer_in_backward steps each unit as soon as its gradients are final, before the global gradient norm exists, "
                f"so it cannot clip by that norm: pass --max_grad_norm 0 (the norm is still logged), got {self.max_grad_norm}"
            )
        if self.gradient_accumulation_steps > 1:
            problems.append(
                f"--optimizer_in_backward steps in each microbatch's backward and cannot accumulate gradients: pass "
                f"--gradient_accumulation_steps 1 (and a larger --train_batch_size), got {self.gradient_accumulation_steps}"
            )
        if self.mixed_precision == "fp16":
            problems.append(
                "--optimizer_in_backward cannot take fp16's loss scaling (the scaler unscales and checks every gradient before any "
                "step): use --mixed_precision bf16 (or auto on a GPU with bf16)"
            )
        if self.optimizer in IN_BACKWARD_REFUSED:
            problems.append(f"--optimizer_in_backward cannot step --optimizer {self.optimizer} a unit at a time: {IN_BACKWARD_REFUSED[self.optimizer]}")
        return problems

    def _run_folder_problems(self) -> list[str]:
        """The run writes checkpoints and exports into its folder (and --overwrite_run clears it): what it reads
        (local caches, the model) must lie outside it, and the folder outside every cache."""
        run_dir = (self.output_dir / self.project_name).resolve()
        problems = []
        for cache in [record.cache_dir for record in self.dataset_records() if not is_remote(record.cache_dir)]:
            cache_dir = Path(cache).resolve()
            if cache_dir == run_dir or cache_dir.is_relative_to(run_dir):
                where = "is the run folder" if cache_dir == run_dir else f"is inside the run folder {run_dir}"
                problems.append(f"cache {cache} {where} (--output_dir/--project_name), which the run writes into: keep caches outside it, or choose another --project_name")
            elif run_dir.is_relative_to(cache_dir):
                problems.append(f"the run folder {run_dir} is inside cache {cache}: give an --output_dir outside the cache")
        model = self.pretrained_model_name_or_path
        if model and Path(model).expanduser().exists() and Path(model).expanduser().resolve().is_relative_to(run_dir):
            problems.append(
                f"--pretrained_model_name_or_path {model} is inside the run folder {run_dir}, whose exports replace what is there: "
                "copy the model outside it, or choose another --project_name"
            )
        return problems

    def _caption_variation_problems(self) -> list[str]:
        """The run-wide and per-cache tag variation: in range, and only in caption mode."""
        problems = []
        records = self.dataset_records()
        per_cache = {
            name: [value for record in records if (value := getattr(record, name)) is not None] or None
            for name in ("shuffle_caption", "keep_tokens", "caption_tag_dropout_rate")
        }
        if not self.encode_captions_each_step:
            varied = [flag for flag, on in (("--shuffle_caption", self.shuffle_caption), ("--keep_tokens", self.keep_tokens),
                                             ("--caption_tag_dropout_rate", self.caption_tag_dropout_rate),
                                             ("--dataset_shuffle_caption", per_cache["shuffle_caption"]), ("--dataset_keep_tokens", per_cache["keep_tokens"]),
                                             ("--dataset_caption_tag_dropout_rate", per_cache["caption_tag_dropout_rate"])) if on]
            if varied:
                problems.append(f"{', '.join(varied)} vary captions at every step, which needs --encode_captions_each_step (cached embeddings are fixed)")
        if any(keep < 0 for keep in [self.keep_tokens, *(per_cache["keep_tokens"] or ())]):
            problems.append(f"--keep_tokens and --dataset_keep_tokens must be >= 0, got {self.keep_tokens} and {per_cache['keep_tokens']}")
        if not all(0 <= rate <= 1 for rate in [self.caption_tag_dropout_rate, *(per_cache["caption_tag_dropout_rate"] or ())]):
            problems.append(
                "--caption_tag_dropout_rate and --dataset_caption_tag_dropout_rate are shares between 0 and 1, "
                f"got {self.caption_tag_dropout_rate} and {per_cache['caption_tag_dropout_rate']}"
            )
        return problems

    def text_encoder_rates(self) -> dict[str, float]:
        """The peak learning rate of each trained text encoder, by pipeline name: --learning_rate_te1/te2, unset
        = --learning_rate. An encoder at 0 stays frozen and is left out; {} without --train_text_encoder."""
        return {name: self.learning_rate if rate is None else rate for name, rate in self.trained_text_encoders().items()}

    # What each part of the run is built from (its owner's settings type), from the options.

    def caption_variations(self) -> list[CaptionVariation]:
        """Caption mode's tag variation for each cache: its record's setting where given, else the run-wide flag."""
        return [
            CaptionVariation(
                self.shuffle_caption if record.shuffle_caption is None else record.shuffle_caption,
                self.keep_tokens if record.keep_tokens is None else record.keep_tokens,
                self.caption_tag_dropout_rate if record.caption_tag_dropout_rate is None else record.caption_tag_dropout_rate,
            )
            for record in self.dataset_records()
        ]

    def cache_dirs(self) -> list[str]:
        return [record.cache_dir for record in self.dataset_records()]

    def cache_requirements(self) -> CacheRequirements:
        return CacheRequirements(
            self.pretrained_model_name_or_path, self.single_file_config, self.min_resolution, self.max_resolution, self.flip_aug, self.masked_loss
        )

    def data_settings(self) -> DataSettings:
        validating = self.validation_loss or self.validation_image
        records = self.dataset_records()
        weights, repeats = [record.loss_weight for record in records], [record.repeats for record in records]
        return DataSettings(
            self.cache_dirs(), weights if any(weight != 1 for weight in weights) else None, repeats if any(repeat != 1 for repeat in repeats) else None,
            self.flip_aug, self.masked_loss, self.train_batch_size, self.gradient_accumulation_steps, self.num_train_epochs, self.max_train_updates,
            self.dataloader_num_workers,
            SplitSettings(
                self.validation_loss_percent if validating else 0.0,
                self.validation_image_percent if self.validation_image else 0.0,
                self.max_validation_loss_items,
                self.max_validation_images,
            ),
            captions_in_memory=self.encode_captions_each_step,
        )

    def run_facts(self, world_size: int) -> RunFacts:
        return RunFacts(
            self.optimizer, self.weights_dtype, self.use_ema, self.train_text_encoder, self.frozen_text_encoder(),
            self.train_batch_size * world_size, self.gradient_accumulation_steps, self.frozen_unet_blocks(),
        )

    def evaluation_settings(self) -> EvaluationSettings:
        sources = [record.validation_source_dir for record in self.dataset_records()]
        return EvaluationSettings(
            GenerationSettings(self.num_inference_steps, self.guidance_scale),
            loss_schedule=Schedule(self.validation_loss, self.validation_loss_every_n_epochs),
            image_schedule=Schedule(self.validation_image, self.validation_image_every_n_epochs),
            sample_schedule=Schedule(self.save_samples, self.save_samples_every_n_epochs, self.start_save_samples_epoch),
            every_n_updates=self.validation_every_n_updates,
            num_epochs=None if self.max_train_updates else self.num_train_epochs,  # with --max_train_updates the run validates at its end
            metric_weights=MetricWeights(self.inception_weights, self.lpips_weights, self.hpsv2_checkpoint),
            metrics=self.validation_metrics,
            source_dirs=sources if all(source is not None for source in sources) else None,
            sample_prompts_file=self.sample_prompts,
            num_sample_images=self.num_sample_images,
            sample_size=self.max_resolution,
        )

    def export_settings(self, vae_name_or_path: str | None) -> ExportSettings:
        return ExportSettings(
            self.pretrained_model_name_or_path, self.single_file_config, vae_name_or_path, self.sampling_scheduler_overrides(), self.save_diffusers,
            self.save_single_file, self.save_precision, self.project_name, self.save_model_every_n_epochs, self.start_save_model_epoch,
        )


DTYPE_OF_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_compute_dtype(name: str, device: torch.device, weights_dtype: str = "fp32") -> torch.dtype:
    if weights_dtype == "bf16":
        return torch.bfloat16  # validate() allows only auto and bf16 with it
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def with_cache_settings(config: TrainConfig) -> tuple[TrainConfig, CacheCheck]:
    """The run's config: a copy with what the flags leave unset (model, resolution range) taken from the
    caches (the parsed config is not changed), and what the cache check found (cache.check_caches)."""
    caches = check_caches(config.cache_dirs(), config.cache_requirements())
    return dataclasses.replace(config, **caches.taken), caches


def reduce_every_microbatch(config: TrainConfig, gpu_memory_gib: float) -> bool:
    """--gradient_reduction resolved for a GPU of gpu_memory_gib (math.inf without a GPU): on a 24 GB card the
    unsharded fp32 gradient of SDXL (10.3 GB) does not fit beside the rest, so accumulation there reduce-scatters
    after every microbatch."""
    if config.gradient_reduction != "auto":
        return config.gradient_reduction == "every_microbatch"
    return gpu_memory_gib < 40 and config.gradient_accumulation_steps > 1


def device_memory_gib(device: torch.device) -> float:
    """A GPU's memory in GiB; math.inf for the CPU (no card size to fit)."""
    return torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else math.inf


def gpu_compute_dtype(config: TrainConfig) -> torch.dtype:
    """The compute dtype of this config on a GPU since Ampere (auto: bf16), which the estimates assume; fp16
    has bf16's sizes."""
    return resolve_compute_dtype("bf16" if config.mixed_precision == "auto" else config.mixed_precision, torch.device("cuda"), config.weights_dtype)


def learning_rate_schedule(config: TrainConfig, total_updates: int) -> LearningRateSchedule:
    """The schedule is a function of optimizer updates only (not microbatches, epochs or processes)."""
    return LearningRateSchedule(
        config.learning_rate_scheduler,
        config.learning_rate,
        math.ceil(config.percent_lr_warm_up_steps * total_updates),
        total_updates,
        config.lr_num_cycles,
        config.polynomial_lr_end,
        config.polynomial_power,
    )


def memory_settings(config: TrainConfig) -> list[EstimateSettings]:
    """The per-GPU loads of this configuration that --estimate_memory judges, for config.estimate_gpus GPUs
    (0: this machine's). With --gradient_reduction auto and accumulation, cards under 40 GB reduce every
    microbatch and larger ones once per update (reduce_every_microbatch): both loads, every microbatch first."""
    from sdxl_trainer.estimates.fake_run import EstimateSettings

    machine_gpus = max(torch.cuda.device_count(), 1)
    gpus = config.estimate_gpus or machine_gpus
    # A GPU holds what full sharding over its group gives it (one group of all GPUs without --replicate_groups);
    # under HSDP without --estimate_gpus this machine is one group.
    shard_group = config.estimate_gpus // config.replicate_groups if config.estimate_gpus else machine_gpus
    compute_dtype = gpu_compute_dtype(config)
    reductions = {config.gradient_reduction == "every_microbatch"}
    if config.gradient_reduction == "auto" and uses_sharding(gpus, config.cpu_offload):  # a plain module has no reduction to choose
        reductions = {True, False} if config.gradient_accumulation_steps > 1 else {False}
    return [
        EstimateSettings(
            world_size=shard_group, train_batch_size=config.train_batch_size, gradient_accumulation_steps=config.gradient_accumulation_steps,
            resolution=config.max_resolution or 1024, compute_dtype=compute_dtype, optimizer=config.optimizer,  # no cache read: SDXL's own size
            gradient_checkpointing=config.gradient_checkpointing, reshard_after_forward=config.reshard_after_forward,
            reduce_every_microbatch=reduce_every_microbatch, cpu_offload=config.cpu_offload, use_ema=config.use_ema, ema_on_cpu=config.ema_on_cpu,
            weights_dtype=DTYPE_OF_NAME[config.weights_dtype], train_text_encoder=config.train_text_encoder,
            reduce_dtype=DTYPE_OF_NAME[config.reduce_dtype], optimizer_in_backward=config.optimizer_in_backward,
            block_lr=tuple(config.block_lr) if config.block_lr else None,
        )  # fmt: skip
        for reduce_every_microbatch in sorted(reductions, reverse=True)
    ]


def speed_settings(config: TrainConfig) -> SpeedSettings:
    """What --estimate_speed judges: config.estimate_gpus GPUs of the kind --gpu (0: this machine's count), the
    batch, resolution and sharding options; --gradient_reduction auto resolved as on that GPU (reduce_every_microbatch)."""
    from sdxl_trainer.estimates.speed_estimate import GPUS, SpeedSettings

    gpus = config.estimate_gpus or max(torch.cuda.device_count(), 1)
    return SpeedSettings(
        gpus=gpus, replicate_groups=config.replicate_groups if gpus % config.replicate_groups == 0 else 1, train_batch_size=config.train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps, resolution=config.max_resolution or 1024,
        compute_bytes=gpu_compute_dtype(config).itemsize,
        gradient_checkpointing=config.gradient_checkpointing, reshard_after_forward=config.reshard_after_forward,
        reduce_every_microbatch=reduce_every_microbatch(config, GPUS[config.gpu].memory_gib), gpu=config.gpu, interconnect=config.interconnect,
        reduce_bytes=DTYPE_OF_NAME[config.reduce_dtype].itemsize, optimizer=config.optimizer,
    )  # fmt: skip
