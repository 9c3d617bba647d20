"""Full fine-tuning of the SDXL UNet (and optionally both text encoders) from a latent cache, sharded with
PyTorch FSDP2 over every process.

Launch with train.sh (torchrun, one process per GPU; 2 CPU processes without a GPU), or accelerate launch.
Reads caches written by sdxl_process_data_dir.py, so only the UNet is loaded (the text encoders too in
caption mode, --encode_captions_each_step), never the VAE.
Reads top to bottom: configuration, set-up (world, data, model, optimizer), the training loop, export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tqdm import tqdm

from sdxl_trainer.buckets import BUCKET_TABLE_VERSION, validate_resolution
from sdxl_trainer.cache import CacheError, CacheSettings, read_cache_info, read_empty_prompt, settings_differences
from sdxl_trainer.checkpoint import (
    CheckpointError,
    DataPosition,
    TrainerState,
    Verification,
    find_latest_checkpoint,
    load_training_state,
    read_trainer_state,
    set_aside_later_checkpoints,
    verify_checkpoint,
)
from sdxl_trainer.checkpointer import Checkpointer, SavePolicy
from sdxl_trainer.config import config_to_dict, option, parse_config, write_resolved_config
from sdxl_trainer.data import CachedDataset, DataStream, EpochPlanner, bucket_counts, small_buckets
from sdxl_trainer.diffusion import HuberSchedule, LossType, NoiseSettings, TimestepBias, TimestepSampling, biased_timesteps, build_noise_scheduler, timestep_weights
from sdxl_trainer.ema import ShardedEMA
from sdxl_trainer.evaluation import Evaluator, PipelineSource, Schedule
from sdxl_trainer.library_noise import hide_library_progress_bars
from sdxl_trainer.lr_schedule import LearningRateSchedule, ScheduleName
from sdxl_trainer.holdout import HOLDOUT_FILE, HoldoutError, SplitSettings, dataset_item_keys, load_or_choose_holdout
from sdxl_trainer.metrics import METRICS, MetricWeights, MetricWeightsError, load_image_metrics
from sdxl_trainer.sample_prompts import DEFAULT_SAMPLE_PROMPTS, choose_sample_prompts, column_seeds, read_prompts
from sdxl_trainer.sampling import GenerationSettings
from sdxl_trainer.validation import ImageValidator
from sdxl_trainer.captions import CaptionVariation, StepCaptionEncoder
from sdxl_trainer.encoding import TOKENS_PER_CHUNK, load_text_encoders, model_fingerprint
from sdxl_trainer.tiny_model import TEXT_MAX_LENGTH
from sdxl_trainer.export import ExportError, save_pipeline
from sdxl_trainer.monitor import ConsoleLog, MetricsWriter, TrainingMonitor, WandbSettings
from sdxl_trainer.optimizers import build_optimizer
from sdxl_trainer.parallel import World, broadcast_text, init_distributed, prepare_text_encoder, prepare_unet, shutdown_distributed, uses_sharding
from sdxl_trainer.single_file import SDXL_CONFIG_SOURCE, config_source, is_single_file, load_unet, model_location_problem
from sdxl_trainer.run_folder import RunFolderBusy, RunFolderLock, earlier_run_outputs
from sdxl_trainer.stop_request import StopRequest
from sdxl_trainer.train_step import TrainStep
from sdxl_trainer.trained_models import TEXT_ENCODER_NAMES, TrainedModels, text_encoder_label
from sdxl_trainer.watchdog import JobWatchdog

if TYPE_CHECKING:
    from sdxl_trainer.memory_estimate import EstimateSettings  # imported when used: torch's memory trackers


@dataclass
class TrainConfig:
    cached_dataset_dirs: list[str] = option(
        help="caches written by sdxl_process_data_dir.py (one or more): folders, or s3://bucket/prefix in S3-compatible object storage "
        "(read with ranged requests; credentials the standard AWS way, AWS_ENDPOINT_URL_S3 for MinIO, R2, B2)"
    )
    dataset_repeats: list[float] | None = option(
        None,
        help="times each --cached_dataset_dirs entry's items are trained per epoch, one number per entry in the same order: 3 = three "
        "copies, each with its own noise and caption draws; 0.5 = a seeded half of the items, another half every epoch; None = 1 for all",
    )
    dataset_loss_weights: list[float] | None = option(
        None,
        help="a weight for each --cached_dataset_dirs entry's training loss, one number per entry in the same order (kohya's prior_loss_weight, "
        "OneTrainer's concept loss_weight): each sample's loss is multiplied by its cache's weight before the batch mean, so 0.5 halves "
        "that cache's pull on the weights; the validation loss stays unweighted; None = 1 for all",
    )
    pretrained_model_name_or_path: str | None = option(
        None,
        help="SDXL model to fine-tune: hub id, local diffusers folder, or single-file .safetensors; must be the one the caches were made with; "
        "None = that one, as its cache_info.json names it",
    )
    single_file_config: str = option(
        SDXL_CONFIG_SOURCE, help="diffusers config (hub id or folder) describing a single-file --pretrained_model_name_or_path; only its config files are read"
    )
    output_dir: Path = option(Path("output"), help="runs are written to OUTPUT_DIR/PROJECT_NAME")
    project_name: str = option("sdxl_finetune", help="name of this run's folder inside --output_dir")
    log_dir: Path | None = option(None, help="TensorBoard folder; None = OUTPUT_DIR/PROJECT_NAME/tensorboard")
    log_every_n_updates: int = option(1, help="write the training scalars every N updates (loss and gradient norm averaged over them)")
    report_to_wandb: bool = option(False, help="also log scalars, sample grids and the config to Weights & Biases (run `wandb login` first, or set WANDB_MODE=offline)")
    wandb_project: str = option("sdxl_finetune", help="Weights & Biases project of the run (the run's name is --project_name)")
    min_resolution: int | None = option(None, help="smallest bucket category in px; None = the caches' (read from them); given, it must equal theirs")
    max_resolution: int | None = option(
        None, help="largest bucket category in px (also the sample images' size); None = the caches' (read from them); given, it must equal theirs"
    )
    train_batch_size: int = option(1, help="images per GPU per microbatch")
    gradient_accumulation_steps: int = option(1, help="microbatches per optimizer update; effective batch = train_batch_size x processes x this")
    gradient_reduction: Literal["auto", "every_microbatch", "once_per_update"] = option(
        "auto",
        help="when accumulated gradients are reduce-scattered: once_per_update (least communication; FSDP2 holds the full "
        "fp32 gradient, 10.3 GB for SDXL, on every GPU meanwhile) or every_microbatch (sharded gradients only, more "
        "communication); auto = every_microbatch on GPUs under 40 GB with accumulation, else once_per_update; "
        "unused on one process without --cpu_offload (the UNet is not sharded there)",
    )
    num_train_epochs: int = option(10, help="passes over the training items")
    max_train_updates: int = option(
        0,
        help="train this many optimizer updates in all, as many epochs or part of one as that takes, instead of --num_train_epochs "
        "(kohya's --max_train_steps); the LR schedule spans them; 0 = off",
    )
    learning_rate: float = option(1e-5, help="peak learning rate")
    learning_rate_scheduler: ScheduleName = option("constant_with_warmup", help="learning-rate schedule over optimizer updates")
    percent_lr_warm_up_steps: float = option(0.05, help="share (0-1) of all optimizer updates spent warming up linearly from 0")
    lr_num_cycles: int = option(1, help="hard restarts for cosine_with_restarts")
    polynomial_lr_end: float = option(1e-7, help="final learning rate of the polynomial schedule")
    polynomial_power: float = option(1.0, help="power of the polynomial schedule (1 = linear decay)")
    optimizer: Literal["adamw8bit", "adamw", "adafactor", "lion"] = option(
        "adamw8bit",
        help="adamw8bit = 8-bit AdamW (torchao's state, 2 bytes per weight, stepped many tensors per kernel); adamw = fp32 AdamW (8 bytes); "
        "adafactor = factored second moments, no momentum (least memory); lion = sign updates, one fp32 momentum "
        "(4 bytes; use a 3-10x lower --learning_rate)",
    )
    adam_beta1: float = option(0.9, help="beta1 of AdamW and Lion")
    adam_beta2: float | None = option(None, help="beta2 of AdamW and Lion; None = the optimizer's own default: 0.999 for AdamW, 0.99 for Lion (the paper's)")
    adam_epsilon: float = option(1e-8, help="AdamW's epsilon, added to the root of the second moment (keeps tiny moments from blowing up the step)")
    weight_decay: float = option(1e-2, help="decoupled weight decay of every optimizer")
    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this; 0 = no clipping (the norm is still logged)")
    max_consecutive_skipped_updates: int = option(
        10, help="stop (after saving state) when this many updates in a row have a NaN/inf loss or gradient and are skipped"
    )
    use_ema: bool = option(False, help="keep an exponential moving average of the UNet weights; the export then holds the EMA weights")
    ema_decay: float = option(0.9999, help="EMA decay per update (warmed up as min(decay, (1+n)/(10+n)))")
    ema_on_cpu: bool = option(False, help="keep each rank's EMA shard in CPU memory instead of GPU memory")
    flip_aug: bool = option(
        False,
        help="train each sample's horizontal mirror half the time (drawn per sample and epoch from the seed), from latents the cache "
        "holds (sdxl_process_data_dir.py --flip_aug), with SDXL's crop offset of the mirrored crop; for subjects without a handedness",
    )
    conditional_dropout_percent: float = option(0.1, help="share (0-1) of samples trained with the empty caption, for classifier-free guidance")
    encode_captions_each_step: bool = option(
        False,
        help="caption mode: run both text encoders (frozen, replicated on every GPU: 1.6 GB in bf16) in every step on the captions the "
        "cache keeps, instead of reading its cached embeddings; needed to choose among several captions per image (one per line) "
        "and for --shuffle_caption / --keep_tokens / --caption_tag_dropout_rate",
    )
    shuffle_caption: bool = option(False, help="caption mode: shuffle the comma-separated tags of each caption at every step (seeded per sample)")
    keep_tokens: int = option(0, help="caption mode: leading comma-separated tags (as kohya counts them) never shuffled or dropped, e.g. a trigger word")
    caption_tag_dropout_rate: float = option(0.0, help="caption mode: chance (0-1) of dropping each tag after the --keep_tokens ones, at every step")
    dataset_shuffle_caption: list[bool] | None = option(
        None,
        help="--shuffle_caption for each --cached_dataset_dirs entry, in the same order (true/false), e.g. shuffle a tag dataset's "
        "captions and keep a prose dataset's as written; None = --shuffle_caption for all",
    )
    dataset_keep_tokens: list[int] | None = option(None, help="--keep_tokens for each --cached_dataset_dirs entry, in the same order; None = --keep_tokens for all")
    dataset_caption_tag_dropout_rate: list[float] | None = option(
        None, help="--caption_tag_dropout_rate for each --cached_dataset_dirs entry, in the same order; None = --caption_tag_dropout_rate for all"
    )
    train_text_encoder: bool = option(
        False,
        help="caption mode: train both text encoders with the UNet (fp32 weights sharded like the UNet's: about 8 GB more over all "
        "GPUs with adamw8bit); checkpoints, validation, samples and exports then hold the trained encoders",
    )
    learning_rate_te1: float | None = option(
        None, help="peak learning rate of text encoder 1 (CLIP ViT-L) with --train_text_encoder; None = --learning_rate; 0 keeps it frozen"
    )
    learning_rate_te2: float | None = option(
        None, help="peak learning rate of text encoder 2 (OpenCLIP ViT-bigG) with --train_text_encoder; None = --learning_rate; 0 keeps it frozen"
    )
    prediction_type: Literal["epsilon", "v_prediction"] = option("epsilon", help="training target; SDXL base predicts epsilon")
    zero_terminal_snr: bool = option(
        False, help="rescale the noise schedule to zero SNR at the last timestep (needs --prediction_type v_prediction)"
    )
    min_snr_gamma: float = option(0.0, help="Min-SNR loss weighting gamma (5 is the paper's value); 0 = off")
    noise_offset: float = option(0.0, help="std of a per-channel offset added to the noise (0.03-0.1 helps very dark/bright images); 0 = off")
    noise_offset_random_strength: bool = option(
        False, help="draw each sample's offset std uniformly from [0, --noise_offset) (kohya's flag; drawn per sample here, per batch there)"
    )
    ip_noise_gamma: float = option(
        0.0,
        help="input perturbation (Ning et al. 2023; kohya's flag): the UNet's input is noised with noise + gamma * a second noise while "
        "the target keeps the first, against exposure bias; about 0.1 is the usual value; 0 = off",
    )
    ip_noise_gamma_random_strength: bool = option(
        False, help="draw each sample's gamma uniformly from [0, --ip_noise_gamma) (kohya's flag; drawn per sample here, per batch there)"
    )
    min_timestep: int = option(0, help="smallest training timestep drawn (inclusive)")
    max_timestep: int = option(1000, help="training timesteps are drawn below this (exclusive); SDXL has 1000")
    timestep_sampling: TimestepSampling = option(
        "uniform",
        help="distribution of training timesteps over [--min_timestep, --max_timestep): uniform, or logit_normal = "
        "sigmoid(x) of x ~ N(--logit_mean, --logit_std) mapped onto that range (OneTrainer's LOGIT_NORMAL; SD3's sampling), "
        "which favours the middle timesteps",
    )
    logit_mean: float = option(0.0, help="logit_normal: mean of x; > 0 moves the draws towards noisier (later) timesteps")
    logit_std: float = option(1.0, help="logit_normal: std of x (> 0); smaller concentrates the draws around the middle")
    timestep_bias_strategy: TimestepBias = option(
        "none",
        help="draw some timesteps --timestep_bias_multiplier times as often (diffusers' SDXL example, SimpleTuner): earlier = the "
        "first --timestep_bias_portion of the 1000 (low noise: fine detail), later = the last portion (high noise: composition, "
        "colour), range = [--timestep_bias_begin, --timestep_bias_end); none = off. Applies on top of --timestep_sampling",
    )
    timestep_bias_multiplier: float = option(
        1.0, help="weight factor of the biased timesteps: 2 = twice as often, 0.5 = half as often, 0 = never (diffusers refuses 0)"
    )
    timestep_bias_begin: int = option(0, help="range: first biased timestep (inclusive)")
    timestep_bias_end: int = option(1000, help="range: end of the biased timesteps (exclusive, like diffusers' slice)")
    timestep_bias_portion: float = option(0.25, help="earlier / later: share (0-1) of the 1000 timesteps biased: the first or last int(portion * 1000)")
    loss_type: LossType = option(
        "l2",
        help="elementwise loss of prediction - target d (kohya's --loss_type): l2 = d^2; l1 = |d|; huber = 2c(sqrt(d^2 + c^2) - c), "
        "about d^2 below the threshold c and 2c|d| above, so outliers pull less; smooth_l1 = the same without the factor c "
        "(about d^2/c, then 2|d|). Validation loss stays MSE whatever this is",
    )
    huber_schedule: HuberSchedule = option(
        "snr",
        help="huber / smooth_l1: the threshold c at timestep t (kohya's): constant = --huber_c; exponential = huber_c^(t/1000), "
        "1 at t = 0 down to --huber_c; snr = (1 - huber_c) / (1 + sigma_t)^2 + huber_c, sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t): "
        "near 1 (MSE-like) at low noise, --huber_c at high noise",
    )
    huber_c: float = option(0.1, help="huber / smooth_l1: the threshold (constant) or the one reached at high noise (exponential, snr); > 0, at most 1 with a schedule")
    debiased_estimation_loss: bool = option(
        False,
        help="weight each sample's loss by 1/sqrt(SNR) (epsilon) or 1/(SNR + 1) (v-prediction), SNR capped at 1000: kohya's "
        "--debiased_estimation_loss (Yu et al. 2023), which evens out how much each timestep is learned; after Min-SNR if both are on",
    )
    masked_loss: bool = option(
        False,
        help="weight each latent pixel's loss by the item's loss mask (cached with sdxl_process_data_dir.py --mask_files or --alpha_mask: "
        "black = not learned), to train a subject without its background; items without a mask train everywhere (kohya's --masked_loss)",
    )
    masked_loss_normalize_area: bool = option(
        False,
        help="with --masked_loss: a sample's loss is its mean over the mask's area instead of over the whole latent, so a small "
        "subject is learned as strongly as a large one (OneTrainer's normalize_masked_area_loss; kohya does not)",
    )
    mixed_precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="UNet compute precision over fp32 master weights (FSDP2's param dtype; torch.autocast on one process): auto = bf16 where the GPU supports it, else fp16; fp32 on CPU (bf16 is emulated there, about 5x slower)"
    )
    weights_dtype: Literal["fp32", "bf16"] = option(
        "fp32",
        help="dtype of the trained weights and their gradients: fp32 (master weights; compute in --mixed_precision) or bf16 "
        "(half the memory of weights and gradients, compute in bf16, gradients accumulated in bf16; every optimizer computes in "
        "fp32 and rounds the new weights stochastically, so updates below bf16's resolution still land on average; kohya's --full_bf16)",
    )
    gradient_checkpointing: bool = option(
        True, help="recompute activations in backward (the UNet's, and trained text encoders'): much less memory, about 30%% more compute"
    )
    cpu_offload: bool = option(
        False,
        help="keep the sharded weights, gradients and optimizer state in CPU memory (FSDP2 CPU offload): one 24 GB GPU "
        "can then train the full UNet, at the cost of host-device copies and an optimizer step on the CPU",
    )
    reshard_after_forward: bool = option(True, help="FSDP FULL_SHARD (True, least memory) or SHARD_GRAD_OP (False, faster, more memory); unused where the UNet is not sharded")
    replicate_groups: int = option(
        1,
        help="HSDP: split the processes into this many groups of consecutive ranks (give the number of machines); models are sharded "
        "within a group and replicated across groups, so weights are all-gathered over each machine's NVLink instead of the network. "
        "Each GPU then holds 1/(GPUs per group) of the weights and optimizer state instead of 1/(all GPUs); 1 = shard over every GPU",
    )
    compile_unet: bool = option(False, help="torch.compile each transformer and ResNet block (regional): faster steps after a compile of minutes")
    allow_tf32: bool = option(True, help="TF32 matmuls and convolutions for fp32 work on Ampere and newer GPUs")
    set_seed: int | None = option(None, help="seed for data order, noise and dropout; None = a random seed, recorded in the run's config.json")
    dataloader_num_workers: int = option(2, help="background processes reading cache shards per rank; 0 = read in the training process")
    validation_every_n_updates: int = option(
        0, help="also run every validation that is on (loss, images, sample row) after every N updates; 0 = by epochs only"
    )
    validation_loss: bool = option(True, help="validation loss on held-out items (fixed noise and timesteps) before training and every N epochs")
    validation_loss_every_n_epochs: int = option(1, help="epochs between validation losses (0 = only before training)")
    validation_loss_percent: float = option(0.10, help="share (0-1) of items held out for the validation loss (never trained on)")
    max_validation_loss_items: int = option(5000, help="at most this many validation-loss items (0 = no cap)")
    validation_image: bool = option(True, help="generate the held-out captions' images and score them (FID, KID, IS, LPIPS, HPSv2.1) every N epochs")
    validation_image_every_n_epochs: int = option(1, help="epochs between image validations (0 = only before training)")
    validation_image_percent: float = option(0.10, help="share (0-1) of items whose images are generated and scored (a subset of the loss items)")
    max_validation_images: int = option(1000, help="at most this many validation images (0 = no cap)")
    validation_source_dirs: list[Path] | None = option(
        None, help="the image folders the caches were made from (one per cache, same order): real images for FID/LPIPS; None = decoded cached latents"
    )
    validation_metrics: list[str] | None = option(
        None, help=f"metrics that must be computed (missing weights are then an error), from {METRICS}; None = every metric whose weights are found"
    )
    inception_weights: Path | None = option(None, help="InceptionV3 file for FID/KID/IS (weights-inception-2015-12-05-6726825d.pth); None = TORCH_HOME cache or download")
    lpips_weights: Path | None = option(None, help="AlexNet file for LPIPS (alexnet-owt-7be5be79.pth); None = TORCH_HOME cache or download")
    hpsv2_checkpoint: Path | None = option(None, help="HPS_v2.1_compressed.pt; None = Hugging Face cache (xswu/HPSv2) or download")
    save_samples: bool = option(True, help="add a row of sample images to OUTPUT_DIR/PROJECT_NAME/samples/sample_grid.png before training and every N epochs")
    num_sample_images: int = option(8, help="sample images per row: the --sample_prompts topped up with dataset captions")
    save_samples_every_n_epochs: int = option(1, help="epochs between sample rows (0 = only the base model's row)")
    start_save_samples_epoch: int = option(1, help="first epoch (counting from 1) after which sample rows are added")
    sample_prompts: Path = option(
        DEFAULT_SAMPLE_PROMPTS,
        help="text file, one prompt per line (# = comment), each with optional kohya-style options: --w WIDTH --h HEIGHT --d SEED "
        "--l GUIDANCE --s STEPS --n NEGATIVE; default: sample_prompts.txt beside this script",
    )
    num_inference_steps: int = option(30, help="denoising steps of validation and sample images (a sample prompt's --s overrides it)")
    guidance_scale: float = option(5.0, help="classifier-free guidance of validation and sample images (a sample prompt's --l overrides it)")
    handoff_dir: Path | None = option(None, help="folder through which the trained UNet reaches every process for images; None = /dev/shm, else the temp folder")
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the exported models")
    save_diffusers: bool = option(True, help="export the trained pipeline: OUTPUT_DIR/PROJECT_NAME/pipeline at the end, pipeline_epoch_NNNN at epoch saves")
    save_single_file: bool = option(
        False,
        help="also export each model as one SDXL .safetensors file (A1111 / ComfyUI / kohya layout) beside the pipeline, with its scheduler config "
        "for diffusers; with --no-save_diffusers, only those",
    )
    save_model_every_n_epochs: int = option(1, help="export the model (and save state, with --save_state) after every N epochs; 0 = only at the end")
    start_save_model_epoch: int = option(1, help="first epoch (counting from 1) after which the epoch saves happen")
    save_state: bool = option(
        True,
        help="save resumable training state (sharded UNet, optimizer, EMA, LR schedule, data position, RNG) to "
        "OUTPUT_DIR/PROJECT_NAME/checkpoints at epoch saves, every --save_state_every_n_updates, on SIGTERM/SIGINT and at the end",
    )
    save_state_every_n_updates: int = option(0, help="also save state every N optimizer updates (0 = off); with week-long epochs, set this")
    checkpoints_total_limit: int = option(2, help="keep only the newest K state checkpoints (0 = keep all); exported models are never deleted")
    estimate_memory: bool = option(
        False,
        help="print this configuration's memory per GPU at full SDXL size, by category, and which cards (16/24/48/80 GB) it fits, "
        "then exit: the trainer's own code on fake tensors, no GPU, model download or cache needed (minutes on a CPU); "
        "square --max_resolution latents, 1024 px where it is not given",
    )
    estimate_gpus: int = option(0, help="GPUs (all machines together) --estimate_memory assumes; 0 = this machine's GPUs, 1 without any")
    load_saved_state: str | None = option(
        None,
        help="resume from a state checkpoint folder, or 'latest' = the newest complete one in OUTPUT_DIR/PROJECT_NAME/checkpoints "
        "(starts from scratch if there is none, so one command serves the first start and every restart)",
    )
    overwrite_run: bool = option(
        False,
        help="start over in a run folder that holds an earlier run's checkpoints or exported models: its checkpoints are deleted "
        "at the start and its exports replaced as this run exports (without this flag such a start is refused)",
    )

    def validate(self) -> list[str]:
        problems = []
        for name in ("min_resolution", "max_resolution"):
            if getattr(self, name) is None:
                continue
            try:
                validate_resolution(getattr(self, name), f"--{name}")
            except ValueError as error:
                problems.append(str(error))
        for name in ("train_batch_size", "gradient_accumulation_steps", "log_every_n_updates", "num_train_epochs", "start_save_model_epoch", "num_sample_images", "num_inference_steps"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        for name in ("percent_lr_warm_up_steps", "conditional_dropout_percent", "validation_loss_percent", "validation_image_percent"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"--{name} is a share between 0 and 1 (0.1 = 10%), got {getattr(self, name)}")
        unknown_metrics = set(self.validation_metrics or ()) - set(METRICS)
        if unknown_metrics:
            problems.append(f"--validation_metrics: unknown {sorted(unknown_metrics)}; choose from {METRICS}")
        for name in ("dataset_repeats", "dataset_loss_weights"):  # one positive number per cache
            values = getattr(self, name)
            if values is not None and len(values) != len(self.cached_dataset_dirs):
                problems.append(f"--{name} needs one number per --cached_dataset_dirs entry ({len(self.cached_dataset_dirs)}), got {len(values)}")
            if any(not 0 < value < math.inf for value in values or ()):
                problems.append(f"--{name} must be > 0 and finite (leave a cache out instead of 0), got {values}")
        if self.validation_source_dirs is not None and len(self.validation_source_dirs) != len(self.cached_dataset_dirs):
            problems.append("--validation_source_dirs needs one image folder per --cached_dataset_dirs entry, in the same order")
        if not self.sample_prompts.is_file():
            problems.append(f"--sample_prompts {self.sample_prompts} does not exist")
        elif self.save_samples:
            try:
                read_prompts(self.sample_prompts)
            except ValueError as error:
                problems.append(f"--sample_prompts: {error}")
        if self.weights_dtype == "bf16" and self.mixed_precision in ("fp16", "fp32"):
            problems.append(f"--weights_dtype bf16 computes in bf16: drop --mixed_precision {self.mixed_precision} (or pass bf16), or keep fp32 weights")
        for name in ("save_model_every_n_epochs", "save_state_every_n_updates", "checkpoints_total_limit", "validation_loss_every_n_epochs",
                     "validation_image_every_n_epochs", "save_samples_every_n_epochs", "max_validation_loss_items", "max_validation_images",
                     "validation_every_n_updates"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0 (0 turns it off)")
        if self.estimate_gpus < 0:
            problems.append("--estimate_gpus must be >= 0 (0 = this machine's GPUs)")
        if self.replicate_groups < 1:
            problems.append("--replicate_groups must be >= 1 (1 = shard over every GPU)")
        elif self.estimate_memory and self.estimate_gpus % self.replicate_groups:
            problems.append(f"--estimate_gpus {self.estimate_gpus} does not split into --replicate_groups {self.replicate_groups} equal groups")
        if self.max_train_updates < 0:
            problems.append("--max_train_updates must be >= 0 (0 = --num_train_epochs decides)")
        if self.max_grad_norm < 0:
            problems.append("--max_grad_norm must be >= 0 (0 turns clipping off)")
        if self.max_consecutive_skipped_updates < 1:
            problems.append("--max_consecutive_skipped_updates must be at least 1")
        if not 0 < self.ema_decay < 1:
            problems.append(f"--ema_decay must be between 0 and 1 (typically 0.999-0.9999), got {self.ema_decay}")
        if self.min_snr_gamma < 0 or self.noise_offset < 0 or self.ip_noise_gamma < 0:
            problems.append("--min_snr_gamma, --noise_offset and --ip_noise_gamma must be >= 0 (0 turns them off)")
        if not 0 <= self.min_timestep < self.max_timestep <= 1000:
            problems.append(f"need 0 <= --min_timestep < --max_timestep <= 1000, got {self.min_timestep} and {self.max_timestep}")
        if not self.encode_captions_each_step:
            varied = [flag for flag, on in (("--shuffle_caption", self.shuffle_caption), ("--keep_tokens", self.keep_tokens),
                                             ("--caption_tag_dropout_rate", self.caption_tag_dropout_rate),
                                             ("--dataset_shuffle_caption", self.dataset_shuffle_caption), ("--dataset_keep_tokens", self.dataset_keep_tokens),
                                             ("--dataset_caption_tag_dropout_rate", self.dataset_caption_tag_dropout_rate)) if on]
            if varied:
                problems.append(f"{', '.join(varied)} vary captions at every step, which needs --encode_captions_each_step (cached embeddings are fixed)")
            if self.train_text_encoder:
                problems.append("--train_text_encoder needs --encode_captions_each_step: cached embeddings cannot carry gradients to the encoders")
        if not self.train_text_encoder and (self.learning_rate_te1 is not None or self.learning_rate_te2 is not None):
            problems.append("--learning_rate_te1 / --learning_rate_te2 apply to trained text encoders: add --train_text_encoder")
        for name in ("dataset_shuffle_caption", "dataset_keep_tokens", "dataset_caption_tag_dropout_rate"):  # one value per cache
            values = getattr(self, name)
            if values is not None and len(values) != len(self.cached_dataset_dirs):
                problems.append(f"--{name} needs one value per --cached_dataset_dirs entry ({len(self.cached_dataset_dirs)}), got {len(values)}")
        if any(keep < 0 for keep in [self.keep_tokens, *(self.dataset_keep_tokens or ())]):
            problems.append(f"--keep_tokens and --dataset_keep_tokens must be >= 0, got {self.keep_tokens} and {self.dataset_keep_tokens}")
        if not all(0 <= rate <= 1 for rate in [self.caption_tag_dropout_rate, *(self.dataset_caption_tag_dropout_rate or ())]):
            problems.append(
                "--caption_tag_dropout_rate and --dataset_caption_tag_dropout_rate are shares between 0 and 1, "
                f"got {self.caption_tag_dropout_rate} and {self.dataset_caption_tag_dropout_rate}"
            )
        if self.zero_terminal_snr and self.prediction_type != "v_prediction":
            problems.append("--zero_terminal_snr needs --prediction_type v_prediction (epsilon cannot be predicted at zero SNR)")
        problems += self._number_problems()
        problems += self._objective_problems()
        if self.load_saved_state not in (None, "latest") and not Path(self.load_saved_state).is_dir():
            problems.append(f"--load_saved_state {self.load_saved_state} is not a folder: give a checkpoint folder (OUTPUT_DIR/PROJECT_NAME/checkpoints/update_N) or 'latest'")
        if self.load_saved_state is not None and self.overwrite_run:
            problems.append("--overwrite_run starts the run over, --load_saved_state continues it: give one of them")
        return problems

    def text_encoder_rates(self) -> dict[str, float]:
        """The peak learning rate of each trained text encoder, by pipeline name: --learning_rate_te1/te2, unset
        = --learning_rate. An encoder at 0 stays frozen and is left out (kohya's rule); {} without
        --train_text_encoder."""
        if not self.train_text_encoder:
            return {}
        rates = (self.learning_rate_te1, self.learning_rate_te2)
        return {name: self.learning_rate if rate is None else rate for name, rate in zip(TEXT_ENCODER_NAMES, rates) if rate != 0}

    def frozen_text_encoder(self) -> str:
        """The text encoder kept frozen by a rate of 0 while the other trains ("" if none)."""
        rates = self.text_encoder_rates()
        return next((name for name in TEXT_ENCODER_NAMES if name not in rates), "") if rates else ""

    def caption_variations(self) -> list[CaptionVariation]:
        """Caption mode's tag variation for each cache: its --dataset_* entry where given, else the run-wide flag."""
        def per_cache(values: list | None, default):
            return values if values is not None else [default] * len(self.cached_dataset_dirs)

        return [
            CaptionVariation(shuffle, keep, dropout)
            for shuffle, keep, dropout in zip(
                per_cache(self.dataset_shuffle_caption, self.shuffle_caption),
                per_cache(self.dataset_keep_tokens, self.keep_tokens),
                per_cache(self.dataset_caption_tag_dropout_rate, self.caption_tag_dropout_rate),
            )
        ]

    def noise_settings(self) -> NoiseSettings:
        """The denoising objective's settings: NoiseSettings' fields are named as these options."""
        return NoiseSettings(**{field.name: getattr(self, field.name) for field in dataclasses.fields(NoiseSettings)})

    def _objective_problems(self) -> list[str]:
        """Timestep sampling and loss options that contradict each other or would change nothing."""
        problems = []
        if not self.logit_std > 0:
            problems.append(f"--logit_std must be > 0, got {self.logit_std}")
        strategy = self.timestep_bias_strategy
        placed = 0 <= self.min_timestep < self.max_timestep <= 1000  # else validate() names the range
        if strategy in ("earlier", "later") and not 0 < self.timestep_bias_portion < 1:
            problems.append(f"--timestep_bias_portion is a share between 0 and 1 (exclusive) of the timesteps to bias, got {self.timestep_bias_portion}")
            placed = False
        if strategy == "range" and not 0 <= self.timestep_bias_begin < self.timestep_bias_end <= 1000:
            problems.append(f"need 0 <= --timestep_bias_begin < --timestep_bias_end <= 1000, got {self.timestep_bias_begin} and {self.timestep_bias_end}")
            placed = False
        if strategy != "none" and (self.timestep_bias_multiplier < 0 or self.timestep_bias_multiplier == 1):
            problems.append(f"--timestep_bias_multiplier must be >= 0 and not 1 (1 biases nothing), got {self.timestep_bias_multiplier}")
        if strategy != "none" and placed:
            biased = biased_timesteps(self.noise_settings())
            drawn = range(self.min_timestep, self.max_timestep)
            inside = len(range(max(biased.start, drawn.start), min(biased.stop, drawn.stop)))
            if inside in (0, len(drawn)):
                problems.append(
                    f"--timestep_bias_strategy {strategy} biases timesteps [{biased.start}, {biased.stop}), which hold "
                    f"{'none' if inside == 0 else 'all'} of the drawn [{self.min_timestep}, {self.max_timestep}), so it changes nothing: "
                    "move the bias or the --min_timestep / --max_timestep range"
                )
            elif self.logit_std > 0 and not np.isfinite(timestep_weights(self.noise_settings())).all():
                problems.append("no timestep is left to draw: the logit-normal weight outside the zero-multiplier bias is 0; widen --logit_std")
        if not (self.huber_c > 0 and (self.huber_schedule == "constant" or self.huber_c <= 1)):
            problems.append(f"--huber_c must be > 0, and at most 1 with --huber_schedule {self.huber_schedule} (it runs from 1 down to huber_c), got {self.huber_c}")
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        needs = {  # option: (what it needs, whether that is on)
            "noise_offset_random_strength": ("--noise_offset", self.noise_offset > 0),
            "ip_noise_gamma_random_strength": ("--ip_noise_gamma", self.ip_noise_gamma > 0),
            "logit_mean": ("--timestep_sampling logit_normal", self.timestep_sampling == "logit_normal"),
            "logit_std": ("--timestep_sampling logit_normal", self.timestep_sampling == "logit_normal"),
            "timestep_bias_multiplier": ("a --timestep_bias_strategy", strategy != "none"),
            "timestep_bias_portion": ("--timestep_bias_strategy earlier or later", strategy in ("earlier", "later")),
            "timestep_bias_begin": ("--timestep_bias_strategy range", strategy == "range"),
            "timestep_bias_end": ("--timestep_bias_strategy range", strategy == "range"),
            "huber_schedule": ("--loss_type huber or smooth_l1", self.loss_type in ("huber", "smooth_l1")),
            "huber_c": ("--loss_type huber or smooth_l1", self.loss_type in ("huber", "smooth_l1")),
            "masked_loss_normalize_area": ("--masked_loss", self.masked_loss),
        }
        for name, (needed, on) in needs.items():
            if not on and getattr(self, name) != defaults[name]:
                problems.append(f"--{name} has no effect without {needed}")
        return problems

    def _number_problems(self) -> list[str]:
        problems = []
        for name in ("learning_rate", "adam_epsilon", "polynomial_power"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.learning_rate == 0 and self.train_text_encoder:
            problems.append("the UNet always trains here: kohya's --learning_rate 0 (text encoders alone) is not supported; give the UNet a rate")
        for name in ("learning_rate_te1", "learning_rate_te2"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                problems.append(f"--{name} must be >= 0 (0 keeps that text encoder frozen), got {getattr(self, name)}")
        if self.train_text_encoder and self.learning_rate_te1 == 0 and self.learning_rate_te2 == 0:
            problems.append("--learning_rate_te1 and --learning_rate_te2 are both 0, so no text encoder trains: drop --train_text_encoder")
        for name in ("weight_decay", "dataloader_num_workers", "guidance_scale", "polynomial_lr_end"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                problems.append(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.lr_num_cycles < 1:
            problems.append(f"--lr_num_cycles must be at least 1, got {self.lr_num_cycles}")
        if self.learning_rate_scheduler == "polynomial" and self.polynomial_lr_end >= self.learning_rate:
            problems.append(f"--polynomial_lr_end ({self.polynomial_lr_end}) must be below --learning_rate ({self.learning_rate})")
        return problems


WEIGHTS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_compute_dtype(name: str, device: torch.device, weights_dtype: str = "fp32") -> torch.dtype:
    if weights_dtype == "bf16":
        return torch.bfloat16  # validate() allows only auto and bf16 with it
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def model_problems(config: TrainConfig) -> list[str]:
    """A model that cannot be found, named by its flag (checked before anything reads it)."""
    problems = [model_location_problem(config.pretrained_model_name_or_path, "--pretrained_model_name_or_path")]
    if is_single_file(config.pretrained_model_name_or_path):
        problems.append(model_location_problem(config.single_file_config, "--single_file_config"))
    return [problem for problem in problems if problem]


def cache_vae(info: CacheSettings) -> str | None:
    """The VAE a cache was encoded with, where it is not its model's own (--vae_name_or_path at caching)."""
    return None if info.vae_name_or_path == info.pretrained_model_name_or_path else info.vae_name_or_path


def check_caches(config: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Every cache must exist and match the trainer's model family and bucket table, and all must share one
    VAE (the one validation decodes with and the export holds) and one caption length. Returns the run's
    config, a copy with what the flags leave unset (model, resolution range) taken from the caches
    (take_cache_settings; the parsed config is not changed), and the problems.
    The model is compared by the fingerprint of its VAE and text-encoder configs (read from config files
    only), not by its path, so a moved or re-downloaded model still matches."""
    infos, problems = {}, []
    for cache_dir in config.cached_dataset_dirs:
        try:
            infos[cache_dir] = read_cache_info(cache_dir)
        except CacheError as error:
            problems.append(str(error))
    if problems:
        return config, problems
    taken, problems = take_cache_settings(config, infos)
    config = dataclasses.replace(config, **taken)
    problems = problems or model_problems(config)
    if problems:
        return config, problems
    vaes = set()
    text_lengths = set()
    for cache_dir, info in infos.items():
        vaes.add(cache_vae(info))
        text_lengths.add(info.text_max_length // TEXT_MAX_LENGTH * TOKENS_PER_CHUNK)
        wanted = dict(
            bucket_table_version=BUCKET_TABLE_VERSION,
            model_fingerprint=model_fingerprint(config.pretrained_model_name_or_path, cache_vae(info), config.single_file_config),
        )
        differences = settings_differences(info, dataclasses.replace(info, **wanted), tuple(wanted))
        if differences:
            problems.append(f"{cache_dir} was made with other settings ({'; '.join(differences)}): re-cache it with this model")
    unflipped = [str(cache_dir) for cache_dir, info in infos.items() if not info.flip_aug]
    if config.flip_aug and unflipped:
        problems.append(
            f"--flip_aug trains the mirrored latents, which {', '.join(unflipped)} lack: re-cache with sdxl_process_data_dir.py --flip_aug "
            "(the cache goes on where it stands only with the settings it was made with, so into a new --cache_dir), or drop --flip_aug"
        )
    if config.masked_loss and not any(info.mask_files or info.alpha_mask for info in infos.values()):
        problems.append(
            "--masked_loss trains with the caches' loss masks, and none of the caches holds any: re-cache with sdxl_process_data_dir.py "
            "--mask_files (name.mask.png beside each image) or --alpha_mask (into a new --cache_dir), or drop --masked_loss"
        )
    if len(vaes) > 1:
        names = sorted(vae or "the model's own" for vae in vaes)
        problems.append(f"the caches were encoded with different VAEs ({', '.join(names)}): re-cache them with one")
    if len(text_lengths) > 1:
        problems.append(
            f"the caches were encoded with different --max_token_length ({', '.join(map(str, sorted(text_lengths)))}): "
            "re-cache them with one, as a batch may mix their items"
        )
    return config, problems


def take_cache_settings(config: TrainConfig, infos: dict[str, CacheSettings]) -> tuple[dict[str, object], list[str]]:
    """What the flags leave unset, from the caches: the model they were made from and their resolution range
    (over several caches: the smallest and the largest category; a batch never mixes bucket sizes, so caches
    of different ranges train together), as config fields to fill. A flag that is given must agree; returns
    the fields and the conflicts."""
    taken: dict[str, object] = {}
    problems = []
    ranges = {
        "min_resolution": min(infos.items(), key=lambda entry: entry[1].min_resolution),
        "max_resolution": max(infos.items(), key=lambda entry: entry[1].max_resolution),
    }
    for name, (cache_dir, info) in ranges.items():
        cached, given = getattr(info, name), getattr(config, name)
        if given is None:
            taken[name] = cached
        elif given != cached:
            problems.append(
                f"--{name} {given} does not match the caches: {cache_dir} was made with --{name} {cached}; drop the flag "
                f"(the trainer takes the range from the caches) or re-cache with --{name} {given}"
            )
    if config.pretrained_model_name_or_path is None:
        models = sorted({info.pretrained_model_name_or_path for info in infos.values()})
        if len(models) > 1:
            problems.append(f"the caches were made from models named {', '.join(models)}: name the one to train with --pretrained_model_name_or_path")
        elif problem := model_location_problem(models[0], "the caches' model (as their cache_info.json names it; pass --pretrained_model_name_or_path where it moved)"):
            problems.append(problem)
        else:
            taken["pretrained_model_name_or_path"] = models[0]
    return taken, problems


def reduce_every_microbatch(config: TrainConfig, device: torch.device) -> bool:
    """--gradient_reduction resolved: on a 24 GB card the unsharded fp32 gradient of SDXL (10.3 GB) does not fit
    beside the rest, so accumulation there reduce-scatters after every microbatch."""
    if config.gradient_reduction != "auto":
        return config.gradient_reduction == "every_microbatch"
    small_gpu = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 40 * 2**30
    return small_gpu and config.gradient_accumulation_steps > 1


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


def agree_on_seed(seed: int | None, device: torch.device) -> int:
    """Use --set_seed, or draw one on rank 0 and share it so every rank plans the same epochs."""
    chosen = torch.tensor([seed if seed is not None else random.randrange(2**31)], dtype=torch.int64, device=device)
    dist.broadcast(chosen, src=0)
    return int(chosen.item())


def resolve_resume_checkpoint(load_saved_state: str | None, checkpoints_dir: Path, is_main: bool) -> tuple[Path | None, list[str]]:
    """Collective: the checkpoint folder to resume from, and what is wrong with it. 'latest' takes the newest
    intact checkpoint (None if there is none yet) and says which damaged ones it skipped; a named folder must
    be intact. Intact includes matching the checksums recorded at save, which every process verifies its
    share of."""
    if load_saved_state is None:
        return None, []
    verifications: dict[Path, Verification] = {}

    def problem_of(path: Path) -> str | None:
        verifications[path] = verify_checkpoint(path)
        return verifications[path].problem

    if load_saved_state == "latest":
        path, skipped = find_latest_checkpoint(checkpoints_dir, problem_of)
        problems = []
        if is_main:
            for damaged, reason in skipped.items():
                print(f"Skipping damaged checkpoint {damaged}: {reason}")
    else:
        path = Path(load_saved_state)
        problem = problem_of(path)
        problems = [f"--load_saved_state {path}: {problem}"] if problem else []
    if is_main and path is not None and not problems:
        print(verifications[path].describe(path))
    return path, problems


def check_before_start(config: TrainConfig, run_dir: Path, world: World) -> tuple[TrainConfig, Path | None, TrainerState | None]:
    """Model, caches and the checkpoint to resume from, all checked before anything loads; every problem
    is reported at once. Returns the run's config (with what the caches supply, check_caches), the checkpoint
    folder and its trainer state (None, None for a fresh start)."""
    config, problems = check_caches(config)
    resume_dir, checkpoint_problems = resolve_resume_checkpoint(config.load_saved_state, run_dir / "checkpoints", world.is_main)
    problems += checkpoint_problems
    if config.load_saved_state is None and not config.overwrite_run:
        problems += earlier_run_problems(run_dir)
    saved = None
    if resume_dir is not None and not checkpoint_problems:
        try:
            saved = read_trainer_state(resume_dir)
            problems += resume_problems(saved, config)
        except CheckpointError as error:
            problems.append(str(error))
    if problems:
        raise SystemExit("Cannot start training:\n  " + "\n  ".join(problems))
    return config, resume_dir, saved


def earlier_run_problems(run_dir: Path) -> list[str]:
    """A fresh start (no --load_saved_state) in the folder of an earlier run would replace its exported model
    and, through --checkpoints_total_limit, its checkpoints."""
    outputs = earlier_run_outputs(run_dir)
    if not outputs:
        return []
    names = ", ".join(str(path.relative_to(run_dir)) for path in outputs[:4]) + (f" and {len(outputs) - 4} more" if len(outputs) > 4 else "")
    return [
        f"{run_dir} holds an earlier run ({names}), which this fresh start would overwrite: continue it with --load_saved_state latest, "
        "start a new run with another --project_name, or start over in this folder with --overwrite_run"
    ]


def resume_problems(saved: TrainerState, config: TrainConfig) -> list[str]:
    """What would make the checkpoint's tensors or data order not fit this run; checked before any work."""
    problems = []
    if saved.optimizer != config.optimizer:
        problems.append(f"the checkpoint holds {saved.optimizer} optimizer state: resume with --optimizer {saved.optimizer}")
    if saved.weights_dtype != config.weights_dtype:
        problems.append(f"the checkpoint holds {saved.weights_dtype} weights: resume with --weights_dtype {saved.weights_dtype}")
    if saved.use_ema != config.use_ema:
        flag = "--use_ema" if saved.use_ema else "--no-use_ema"
        problems.append(f"the checkpoint was saved {'with' if saved.use_ema else 'without'} an EMA: resume with {flag}")
    if saved.train_text_encoder != config.train_text_encoder:
        flag = "--train_text_encoder" if saved.train_text_encoder else "--no-train_text_encoder"
        problems.append(f"the checkpoint was saved {'with' if saved.train_text_encoder else 'without'} trained text encoders: resume with {flag}")
    elif saved.frozen_text_encoder != config.frozen_text_encoder():
        for number, name in enumerate(TEXT_ENCODER_NAMES, start=1):
            if saved.frozen_text_encoder == name:
                problems.append(f"the checkpoint kept text encoder {number} frozen: resume with --learning_rate_te{number} 0")
            elif config.frozen_text_encoder() == name:
                problems.append(f"the checkpoint trained text encoder {number}: resume with --learning_rate_te{number} above 0 (0 keeps it frozen)")
    if config.set_seed is not None and config.set_seed != saved.seed:
        problems.append(f"the checkpoint's run used seed {saved.seed} (data order and noise follow it): drop --set_seed or pass {saved.seed}")
    return problems


def sampling_scheduler_overrides(config: TrainConfig) -> dict:
    """The sampling scheduler must follow the training objective (v-prediction, zero terminal SNR)."""
    overrides = {"prediction_type": config.prediction_type}
    if config.zero_terminal_snr:
        overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return overrides


def caption_chunks(config: TrainConfig) -> int:
    """The caches' caption length in chunks of 75 tokens (check_caches made sure they agree)."""
    return read_cache_info(config.cached_dataset_dirs[0]).text_max_length // TEXT_MAX_LENGTH


def build_evaluator(config: TrainConfig, world, run_dir: Path, dataset: CachedDataset, holdout, noise_scheduler, negative, compute_dtype, seed: int,
                    trained_caption_encoder: StepCaptionEncoder | None) -> Evaluator:
    """Validation loss, validation images and sample grid, as configured. Metric networks load here, once per run."""
    generation = GenerationSettings(config.num_inference_steps, config.guidance_scale)
    validator = None
    if config.validation_image and len(holdout.image_items):
        named_weights = {"fid", "kid", "is"} if config.inception_weights else set()
        named_weights |= {"lpips"} if config.lpips_weights else set()
        named_weights |= {"hpsv2"} if config.hpsv2_checkpoint else set()
        try:
            metrics = load_image_metrics(
                MetricWeights(config.inception_weights, config.lpips_weights, config.hpsv2_checkpoint),
                wanted=config.validation_metrics or METRICS,
                required=set(config.validation_metrics or ()) | named_weights,
                allow_download=os.environ.get("HF_HUB_OFFLINE", "0") in ("0", ""),
                warn=False,  # said below in one line each, not as Python warnings with their source lines
            )
        except MetricWeightsError as error:
            raise SystemExit(f"Cannot start training: {error}") from error
        if world.is_main:
            off_by_reason: dict[str, list[str]] = {}
            for name, reason in metrics.skipped.items():
                off_by_reason.setdefault(reason, []).append(name)
            for reason, names in off_by_reason.items():
                print(f"Warning: validation metrics {names} are off: {reason}.")
        if metrics.enabled:
            validator = ImageValidator(dataset, holdout.image_items, metrics, holdout.seed, world.device, generation, config.validation_source_dirs)
        elif world.is_main:
            print("Warning: no image metric has its weights here, so validation images are not generated (see the warnings above).")
    prompts = []
    if config.save_samples:
        file_prompts, notes = read_prompts(config.sample_prompts)
        if world.is_main:
            for note in notes:
                print(f"Note: {note}")
        prompts = choose_sample_prompts(file_prompts, [dataset.caption(item) for item in range(len(dataset))], config.num_sample_images, seed)
    return Evaluator(
        world,
        None if config.max_train_updates else config.num_train_epochs,  # with --max_train_updates the run validates at its end
        dataset,
        holdout,
        noise_scheduler,
        negative,
        PipelineSource(
            config.pretrained_model_name_or_path, config.single_file_config, compute_dtype, sampling_scheduler_overrides(config), config.handoff_dir, config.project_name,
            cache_vae(read_cache_info(config.cached_dataset_dirs[0])),
        ),
        generation,
        loss_schedule=Schedule(config.validation_loss, config.validation_loss_every_n_epochs),
        image_schedule=Schedule(config.validation_image, config.validation_image_every_n_epochs),
        sample_schedule=Schedule(config.save_samples, config.save_samples_every_n_epochs, config.start_save_samples_epoch),
        validator=validator,
        sample_prompts=prompts,
        sample_seeds=column_seeds(prompts, seed),
        sample_size=config.max_resolution,
        grid_path=run_dir / "samples" / "sample_grid.png",
        caption_chunks=caption_chunks(config),
        trained_caption_encoder=trained_caption_encoder,
    )


def evaluate(evaluator: Evaluator, epochs_done: int | None, models: TrainedModels, ema: ShardedEMA | None, metrics: MetricsWriter, update: int) -> None:
    """Collective: what is due after `epochs_done` epochs, or everything that is on (None: every N updates)."""
    started = time.perf_counter()
    scores = evaluator.after_updates(models, ema, metrics, update) if epochs_done is None else evaluator(epochs_done, models, ema, metrics, update)
    if scores and dist.get_rank() == 0:
        what = f"after update {update}" if epochs_done is None else "base model" if epochs_done == 0 else f"after epoch {epochs_done}"
        numbers = ", ".join(f"{tag.removeprefix('val/')} {value:.4g}" for tag, value in scores.items())
        tqdm.write(f"Validation ({what}, {time.perf_counter() - started:.1f} s): {numbers}")


def export_model(config: TrainConfig, world, models: TrainedModels, ema: ShardedEMA | None, pipeline_dir: Path) -> None:
    """Collective: gather the trained UNet (EMA weights with --use_ema) and text encoders (with
    --train_text_encoder) on rank 0 and write the pipeline (and the single-file checkpoint beside it with
    --save_single_file). Raises ExportError on every rank if the export failed; nothing at pipeline_dir is
    replaced then."""
    weights = models.exported_weights_on_rank0(ema, world.is_main)
    failure = ""
    if world.is_main:
        started = time.perf_counter()
        folder = pipeline_dir if config.save_diffusers else None
        single_file = pipeline_dir.with_suffix(".safetensors") if config.save_single_file else None
        # The run's name, and for an epoch save also its epoch: "my_run", "my_run_epoch_0003".
        title = config.project_name + pipeline_dir.name.removeprefix("pipeline")
        try:
            save_pipeline(
                weights, config.pretrained_model_name_or_path, folder, config.save_precision, sampling_scheduler_overrides(config), config.single_file_config,
                single_file, cache_vae(read_cache_info(config.cached_dataset_dirs[0])), model_title=title,
            )
            encoders = [text_encoder_label(name) for name in TEXT_ENCODER_NAMES if name in weights]
            what = " and ".join(["EMA UNet" if ema is not None else "UNet", *encoders])
            written = " and ".join(str(path) for path in (folder, single_file) if path is not None)
            tqdm.write(f"Saved the trained model ({what}, {config.save_precision}) to {written} in {time.perf_counter() - started:.1f} s.")
        except ExportError as error:
            failure = str(error)
    failure = broadcast_text(failure, world.device)
    if failure:
        raise ExportError(failure)


EXPECTED_ERRORS = (CacheError, CheckpointError, ExportError, HoldoutError, MetricWeightsError)  # their messages say it all


def memory_settings(config: TrainConfig) -> list[EstimateSettings]:
    """The per-GPU loads of this configuration that --estimate_memory judges, for config.estimate_gpus GPUs
    (0: this machine's). With --gradient_reduction auto and accumulation, cards under 40 GB reduce every
    microbatch and larger ones once per update (reduce_every_microbatch): both loads, every microbatch first."""
    from sdxl_trainer.memory_estimate import EstimateSettings  # torch's memory trackers: only here

    machine_gpus = max(torch.cuda.device_count(), 1)
    gpus = config.estimate_gpus or machine_gpus
    # A GPU holds what full sharding over its group gives it (one group of all GPUs without --replicate_groups);
    # under HSDP without --estimate_gpus this machine is one group.
    shard_group = config.estimate_gpus // config.replicate_groups if config.estimate_gpus else machine_gpus
    # auto is bf16 on every GPU since Ampere; fp16 has the same sizes.
    compute_dtype = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.mixed_precision]
    if config.weights_dtype == "bf16":
        compute_dtype = torch.bfloat16
    reductions = {config.gradient_reduction == "every_microbatch"}
    if config.gradient_reduction == "auto" and uses_sharding(gpus, config.cpu_offload):  # a plain module has no reduction to choose
        reductions = {True, False} if config.gradient_accumulation_steps > 1 else {False}
    return [
        EstimateSettings(
            world_size=shard_group, train_batch_size=config.train_batch_size, gradient_accumulation_steps=config.gradient_accumulation_steps,
            resolution=config.max_resolution or 1024, compute_dtype=compute_dtype, optimizer=config.optimizer,  # no cache read: SDXL's own size
            gradient_checkpointing=config.gradient_checkpointing, reshard_after_forward=config.reshard_after_forward,
            reduce_every_microbatch=reduce_every_microbatch, cpu_offload=config.cpu_offload, use_ema=config.use_ema, ema_on_cpu=config.ema_on_cpu,
            weights_dtype=WEIGHTS_DTYPES[config.weights_dtype], train_text_encoder=config.train_text_encoder,
        )  # fmt: skip
        for reduce_every_microbatch in sorted(reductions, reverse=True)
    ]


def print_memory_estimate(config: TrainConfig) -> int:
    """--estimate_memory: the configuration's peak per GPU at full SDXL size (sdxl_trainer/memory_estimate.py),
    each card size judged by its own gradient reduction (memory_settings)."""
    from sdxl_trainer.memory_estimate import estimate_memory  # torch's memory trackers: only here

    if os.environ.get("RANK", "0") != "0":
        return 0
    loads = memory_settings(config)
    gpus = loads[0].world_size
    print(f"Estimating on fake tensors (no GPU needed; a few minutes on a CPU) for {gpus} GPU{'s' if gpus > 1 else ''}...", flush=True)
    for settings in loads:
        started = time.perf_counter()
        estimate = estimate_memory(settings)
        if len(loads) > 1:
            every = settings.reduce_every_microbatch
            cards = "Cards under 40 GB" if every else "Cards of 40 GB and more"
            print(f"{cards} reduce gradients {'every microbatch' if every else 'once per update'} (--gradient_reduction auto):")
        print(estimate.report() + f"\n  (estimated in {time.perf_counter() - started:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    # Every process reads the flags; only the first says what is wrong with them.
    config = parse_config(TrainConfig, argv, description=__doc__, quiet=os.environ.get("RANK", "0") != "0")
    if config.estimate_memory:
        return print_memory_estimate(config)
    hide_library_progress_bars()
    world = init_distributed(config.replicate_groups)
    # Any error on any rank ends every process of the job (see watchdog.py).
    # Rank 0's console also goes to train.log in the run folder (the watchdog's last words included).
    run_dir = config.output_dir / config.project_name
    with ConsoleLog(run_dir / "train.log", world.is_main), JobWatchdog(world.rank, world.world_size, EXPECTED_ERRORS), hold_run_folder(run_dir, world):
        return train(config, world)


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


def train(config: TrainConfig, world: World) -> int:
    run_dir = config.output_dir / config.project_name
    log_dir = config.log_dir or run_dir / "tensorboard"
    compute_dtype = resolve_compute_dtype(config.mixed_precision, world.device, config.weights_dtype)
    weights_dtype = WEIGHTS_DTYPES[config.weights_dtype]

    # ---- validate everything before loading the model --------------------------------------------
    config, resume_dir, saved = check_before_start(config, run_dir, world)
    if config.overwrite_run and world.is_main and earlier_run_outputs(run_dir):
        if (run_dir / "checkpoints").exists():
            shutil.rmtree(run_dir / "checkpoints")
        print(f"--overwrite_run: deleted the earlier run's checkpoints in {run_dir / 'checkpoints'}; its exported models are replaced as this run exports.")
    if saved and world.is_main:
        aside, moved = set_aside_later_checkpoints(run_dir / "checkpoints", saved.update)
        if aside is not None:
            print(
                f"Resuming from update {saved.update}, before this run's newer checkpoints ({', '.join(path.name for path in moved)}): moved them "
                f"to {aside}, so --checkpoints_total_limit and --load_saved_state latest follow the resumed run. Nothing was deleted."
            )
    seed = agree_on_seed(saved.seed if saved else config.set_seed, world.device)
    torch.manual_seed(seed + world.rank)

    # ---- data ------------------------------------------------------------------------------------
    dataset = CachedDataset(config.cached_dataset_dirs, config.dataset_loss_weights, flip_aug=config.flip_aug, loss_masks=config.masked_loss)
    global_batch_size = config.train_batch_size * world.world_size
    bucket_ids = dataset.bucket_ids()
    # Held-out items are chosen once per run (the same on every rank), saved, and never trained on.
    split = SplitSettings(
        config.validation_loss_percent if config.validation_loss or config.validation_image else 0.0,
        config.validation_image_percent if config.validation_image else 0.0,
        config.max_validation_loss_items,
        config.max_validation_images,
    )
    try:
        holdout = load_or_choose_holdout(run_dir / HOLDOUT_FILE, dataset_item_keys(dataset), bucket_ids, split, seed, write=world.is_main)
    except HoldoutError as error:
        raise SystemExit(f"Cannot start training: {error}") from error
    trainable = holdout.trainable(len(dataset))
    repeats = np.asarray(config.dataset_repeats)[dataset.cache_index] if config.dataset_repeats else None
    planner = EpochPlanner(bucket_ids, trainable, global_batch_size, config.gradient_accumulation_steps, seed, repeats)
    per_bucket = bucket_counts(dataset.bucket_sizes, bucket_ids, planner.possible_samples() % len(dataset))
    if per_bucket and max(per_bucket.values()) < global_batch_size:
        # Checked here, before the model loads: the planner would plan no batch at all (a resume with more
        # processes or a larger --train_batch_size than the run that saved it gets here too).
        raise SystemExit(
            f"Cannot start training: no bucket holds one global batch of --train_batch_size {config.train_batch_size} x "
            f"{world.world_size} process{'es' if world.world_size > 1 else ''} = {global_batch_size} items (items per bucket"
            f"{', counting the copies of --dataset_repeats' if config.dataset_repeats else ''}: {per_bucket}): lower --train_batch_size "
            "or run on fewer processes"
        )
    too_small = small_buckets(dataset.bucket_sizes, bucket_ids, planner.epoch_samples(0) % len(dataset), global_batch_size)
    if world.is_main and too_small:
        print(
            f"Warning: {sum(too_small.values())} items in buckets smaller than one global batch of {global_batch_size} "
            f"will not be trained on: {too_small}. Lower --train_batch_size or add images of those shapes to use them."
        )
    first_update = saved.update if saved else 0
    position = DataPosition.epoch_start(0)
    empty_prompt = tuple(tensor.to(world.device) for tensor in read_empty_prompt(config.cached_dataset_dirs[0]))

    # ---- model, optimizer, schedules -------------------------------------------------------------
    if world.device.type == "cuda" and config.allow_tf32:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    # Only the UNet is loaded (and the text encoders in caption mode): latents and caption embeddings come
    # from the cache. Diffusers' default attention processor is PyTorch SDPA (flash / memory-efficient
    # kernels where the GPU has them).
    unet = load_unet(config.pretrained_model_name_or_path, config.single_file_config, weights_dtype)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.to(world.device).train()
    param_dtype = None if compute_dtype == torch.float32 else compute_dtype
    prepare_unet(unet, world, param_dtype, config.reshard_after_forward, compile_blocks=config.compile_unet, cpu_offload=config.cpu_offload)
    noise_scheduler = build_noise_scheduler(
        config_source(config.pretrained_model_name_or_path, config.single_file_config), config.prediction_type, config.zero_terminal_snr
    )
    noise_settings = config.noise_settings()
    caption_encoder = None
    text_encoder_rates = config.text_encoder_rates()
    trained_text_encoders = {}
    if config.encode_captions_each_step:
        # Frozen encoders compute in compute_dtype; trained ones keep master weights in --weights_dtype, sharded like the UNet.
        tokenizers, text_encoders = load_text_encoders(
            config.pretrained_model_name_or_path, world.device, compute_dtype, config.single_file_config,
            trained=tuple(name in text_encoder_rates for name in TEXT_ENCODER_NAMES), checkpointed=config.gradient_checkpointing,
            trained_dtype=weights_dtype,
        )
        trained_text_encoders = {name: encoder for name, encoder in zip(TEXT_ENCODER_NAMES, text_encoders) if name in text_encoder_rates}
        for encoder in trained_text_encoders.values():
            prepare_text_encoder(encoder, world, param_dtype, config.reshard_after_forward, cpu_offload=config.cpu_offload)
        variations = config.caption_variations()
        caption_encoder = StepCaptionEncoder(
            (tokenizers, text_encoders),
            dataset.caption_texts,
            lambda item: variations[dataset.cache_index[item]],
            seed,
            caption_chunks(config),
            world.device,
            trains=config.train_text_encoder,
            framing=dataset.framed,
        )
    models = TrainedModels(unet, trained_text_encoders)
    optimizer = build_optimizer(
        config.optimizer, models.parameter_groups(config.learning_rate, text_encoder_rates), config.learning_rate, config.weight_decay,
        (config.adam_beta1, config.adam_beta2), config.adam_epsilon,
    )
    ema = ShardedEMA(unet, config.ema_decay, on_cpu=config.ema_on_cpu) if config.use_ema else None
    if resume_dir is not None:
        # DCP reshards on load, so the checkpoint may come from another number of processes.
        started = time.perf_counter()
        _, position = load_training_state(resume_dir, models.checkpointed, optimizer, ema)
        if world.is_main:
            print(
                f"Resumed from {resume_dir} in {time.perf_counter() - started:.1f} s: update {first_update}, epoch {position.epoch + 1} "
                f"after {position.updates_in_epoch} of its updates (saved on {saved.world_size} processes, now {world.world_size})."
            )
    elif world.is_main and config.load_saved_state == "latest":
        print(f"No complete checkpoint in {run_dir / 'checkpoints'} yet: starting from the base model.")
    updates_left = max(config.max_train_updates - first_update, 0) if config.max_train_updates else None
    stream = DataStream(
        dataset, planner, position, config.num_train_epochs, world.rank, config.train_batch_size, config.dataloader_num_workers, world.device, updates_left
    )
    total_updates = first_update + stream.num_updates
    if total_updates == 0:
        raise SystemExit(
            f"No optimizer update is possible: {len(dataset)} items, global batch {global_batch_size} x "
            f"{config.gradient_accumulation_steps} accumulation steps. Lower --train_batch_size or --gradient_accumulation_steps."
        )
    train_step = TrainStep(
        unet,
        optimizer,
        learning_rate_schedule(config, total_updates),
        noise_scheduler,
        noise_settings,
        empty_prompt,
        seed,
        config.max_grad_norm,
        # fp16 needs loss scaling; the sharded scaler agrees across ranks on whether a step overflowed.
        scaler=ShardedGradScaler(world.device.type) if compute_dtype == torch.float16 else None,
        ema=ema,
        reduce_every_microbatch=reduce_every_microbatch(config, world.device),
        caption_encoder=caption_encoder,
    )
    if saved:
        train_step.load_state_dict(dataclasses.asdict(saved))
    if world.is_main:
        write_resolved_config(dataclasses.replace(config, set_seed=seed), run_dir / "config.json")  # the seed drawn or resumed, to repeat the run
        print(
            f"{len(dataset)} cached items"
            + (f" ({len(planner.epoch_samples(0))} samples an epoch with --dataset_repeats)" if config.dataset_repeats else "")
            + f", {world.world_size} process{'es' if world.world_size > 1 else ''}, {run_length(config, stream.num_epochs)}, "
            f"{total_updates} optimizer updates of {global_batch_size * config.gradient_accumulation_steps} images, "
            f"compute {str(compute_dtype).removeprefix('torch.')}, "
            + ("bf16 weights (stochastic rounding), " if config.weights_dtype == "bf16" else "")
            + (
                "UNet sharded with FSDP2"
                + (f" within {config.replicate_groups} replicated groups of {world.world_size // config.replicate_groups} (HSDP)" if config.replicate_groups > 1 else "")
                + (", gradients reduced after every microbatch." if train_step.reduce_every_microbatch else ".")
                if uses_sharding(world.world_size, config.cpu_offload)
                else "one process: UNet not sharded" + (" (autocast)." if compute_dtype != torch.float32 else ".")
            )
        )
        if caption_encoder is not None:
            described = (
                variations[0].describe() if len(set(variations)) == 1
                else "; ".join(f"{cache_dir}: {variation.describe()}" for cache_dir, variation in zip(config.cached_dataset_dirs, variations))
            )
            print(f"Caption mode: both text encoders encode every step's captions: {described}.")
        if config.train_text_encoder:
            trained = [f"{text_encoder_label(name)} at {rate:g}" for name, rate in text_encoder_rates.items()]
            frozen = f"; {text_encoder_label(config.frozen_text_encoder())} stays frozen (rate 0)" if config.frozen_text_encoder() else ""
            print(f"Training {' and '.join(trained)} too (peak learning rates; the UNet's: {config.learning_rate:g}){frozen}.")
    wandb_settings = WandbSettings(config.wandb_project, config.project_name, run_dir, config_to_dict(config)) if config.report_to_wandb else None
    metrics = MetricsWriter(log_dir, world.is_main, wandb_settings)
    monitor = TrainingMonitor(metrics, total_updates, first_update, world.device, world.is_main, config.log_every_n_updates)
    evaluator = build_evaluator(
        config, world, run_dir, dataset, holdout, noise_scheduler, empty_prompt, compute_dtype, seed, caption_encoder if config.train_text_encoder else None
    )
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        SavePolicy(config.save_state, config.save_state_every_n_updates, config.checkpoints_total_limit),
        models.checkpointed,
        train_step,
        run_facts=lambda: dict(
            seed=seed,
            optimizer=config.optimizer,
            weights_dtype=config.weights_dtype,
            use_ema=config.use_ema,
            train_text_encoder=config.train_text_encoder,
            frozen_text_encoder=config.frozen_text_encoder(),
            global_batch_size=global_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        ),
        report=monitor.say,
        last_saved_update=first_update if saved else None,
    )
    stop = StopRequest(announce=world.is_main)

    # ---- training loop ---------------------------------------------------------------------------
    try:
        if not saved:
            evaluate(evaluator, 0, models, ema, monitor.metrics, first_update)
        if config.optimizer == "adamw8bit" or config.compile_unet:
            monitor.say(
                f"The first update compiles kernels ({'the 8-bit AdamW step' if config.optimizer == 'adamw8bit' else 'the UNet blocks'}): "
                f"seconds to a minute on a GPU, up to several minutes on a CPU, then reused from {os.environ['TORCHINDUCTOR_CACHE_DIR']} by later runs."
            )
        monitor.throughput.start()
        for update in stream:
            monitor.throughput.data_ready()
            started = time.perf_counter()
            result = train_step(update.microbatches, update.epoch)
            if train_step.updates_done == first_update + 1:
                monitor.say(f"First update done in {time.perf_counter() - started:.1f} s.")
            monitor.throughput.stop(update.images)
            monitor.log_update(train_step.updates_done, update.epoch, result.loss, result.learning_rate, result.grad_norm, result.stepped, train_step.skipped_updates)
            if train_step.consecutive_skipped_updates >= config.max_consecutive_skipped_updates:
                checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
                raise SystemExit(
                    f"Stopped at update {train_step.updates_done}: the last {train_step.consecutive_skipped_updates} updates all had a NaN/inf "
                    f"loss or gradient. State saved to {checkpoint_dir}. Lower --learning_rate, use --mixed_precision bf16 instead of fp16, "
                    "or check the cache with sdxl_process_data_dir.py --verify."
                )
            if stop.agreed(world.device):
                try:
                    checkpoint_dir = checkpointer.before_exit(update.position_after, even_without_save_state=True)
                except CheckpointError as error:
                    raise SystemExit(f"Stop requested at update {train_step.updates_done}, and the state could not be saved: {error}") from error
                monitor.say(f"Stopped on request after update {train_step.updates_done}. Resume with: --load_saved_state latest (or {checkpoint_dir}).")
                break
            checkpointer.after_update(update.position_after)
            if validation_due_after(config, train_step.updates_done):
                evaluate(evaluator, None, models, ema, monitor.metrics, train_step.updates_done)
            last_update = train_step.updates_done == total_updates
            if update.ends_epoch:
                finished_epochs = update.epoch + 1
                monitor.log_epoch(finished_epochs)
                if not (config.max_train_updates and last_update):  # the final validation below covers it
                    evaluate(evaluator, finished_epochs, models, ema, monitor.metrics, train_step.updates_done)
                if not last_update and epoch_save_due(config, finished_epochs):
                    export_epoch_model(config, world, models, ema, run_dir / f"pipeline_epoch_{finished_epochs:04d}", monitor)
                    checkpointer.at_epoch_save(update.position_after)
            monitor.throughput.start()
        else:
            if config.max_train_updates and not validation_due_after(config, train_step.updates_done):
                # The run ends inside an epoch or at an epoch end without its own validation: validate what is exported.
                evaluate(evaluator, None, models, ema, monitor.metrics, train_step.updates_done)
            finish(config, world, models, ema, run_dir, checkpointer, stream.position, monitor)
    finally:
        monitor.close()
        stop.restore_handlers()
    shutdown_distributed()
    return 0


def validation_due_after(config: TrainConfig, update: int) -> bool:
    """--validation_every_n_updates: whether everything that is on runs after this update."""
    return bool(config.validation_every_n_updates) and update % config.validation_every_n_updates == 0


def run_length(config: TrainConfig, epochs_planned: int) -> str:
    if not config.max_train_updates:
        return f"{config.num_train_epochs} epochs"
    return f"until update {config.max_train_updates} (--max_train_updates; in {epochs_planned} epoch{'s' if epochs_planned != 1 else ''})"


def epoch_save_due(config: TrainConfig, finished_epochs: int) -> bool:
    """Epoch saves (the exported model and the state) after every --save_model_every_n_epochs epochs."""
    every = config.save_model_every_n_epochs
    return bool(every) and finished_epochs >= config.start_save_model_epoch and finished_epochs % every == 0


def export_epoch_model(config: TrainConfig, world: World, models: TrainedModels, ema: ShardedEMA | None, pipeline_dir: Path, monitor: TrainingMonitor) -> None:
    """An export after an epoch; if it fails (a full disk), training goes on."""
    if not (config.save_diffusers or config.save_single_file):
        return
    try:
        export_model(config, world, models, ema, pipeline_dir)
    except ExportError as error:
        monitor.say(f"Warning: {error} Training goes on.")


def finish(config: TrainConfig, world: World, models: TrainedModels, ema: ShardedEMA | None, run_dir: Path, checkpointer: Checkpointer,
           position: DataPosition, monitor: TrainingMonitor) -> None:
    """The end of a run: its state, then the model. A state that cannot be saved still lets the model be
    exported, then ends the job with exit code 1."""
    monitor.close()
    try:
        checkpointer.before_exit(position)
        state_error = None
    except CheckpointError as error:
        state_error = error
        monitor.say(f"Warning: {error} The model export below goes on.")
    if config.save_diffusers or config.save_single_file:
        export_model(config, world, models, ema, run_dir / "pipeline")
    if state_error is not None:
        raise SystemExit(f"Training finished, but its final state could not be saved: {state_error}")
    log_dir = config.log_dir or run_dir / "tensorboard"
    monitor.say(f"TensorBoard logs: {log_dir}   (view with: tensorboard --logdir {log_dir})")


if __name__ == "__main__":
    sys.exit(main())
