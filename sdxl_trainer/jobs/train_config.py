"""The trainer's configuration: every flag of sdxl_FSDP_train.py, its checks, and what each part of the run
is built from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from sdxl_trainer.cache.buckets import validate_resolution
from sdxl_trainer.cache.compatibility import CacheCheck, CacheRequirements, check_caches
from sdxl_trainer.config import option
from sdxl_trainer.distributed.fsdp import uses_sharding
from sdxl_trainer.evaluation.evaluator import EvaluationSettings, Schedule
from sdxl_trainer.evaluation.metrics import METRICS, MetricWeights
from sdxl_trainer.evaluation.sample_prompts import DEFAULT_SAMPLE_PROMPTS, read_prompts
from sdxl_trainer.evaluation.sampling import GenerationSettings
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE
from sdxl_trainer.outputs.export import ExportSettings
from sdxl_trainer.state.checkpointer import RunFacts
from sdxl_trainer.training.captions import CaptionVariation
from sdxl_trainer.training.holdout import SplitSettings
from sdxl_trainer.training.lr_schedule import LearningRateSchedule, ScheduleName
from sdxl_trainer.training.objective import (
    HuberSchedule,
    LossType,
    NoiseSettings,
    TimestepBias,
    TimestepSampling,
    biased_timesteps,
    timestep_weights,
)
from sdxl_trainer.training.stream import DataSettings
from sdxl_trainer.training.trained_models import TEXT_ENCODER_NAMES

if TYPE_CHECKING:
    from sdxl_trainer.tools.memory_estimate import EstimateSettings  # imported when used: torch's memory trackers


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

    # What each part of the run is built from (its owner's settings type), from the flags.

    def cache_requirements(self) -> CacheRequirements:
        return CacheRequirements(
            self.pretrained_model_name_or_path, self.single_file_config, self.min_resolution, self.max_resolution, self.flip_aug, self.masked_loss
        )

    def data_settings(self) -> DataSettings:
        validating = self.validation_loss or self.validation_image
        return DataSettings(
            self.cached_dataset_dirs, self.dataset_loss_weights, self.dataset_repeats, self.flip_aug, self.masked_loss, self.train_batch_size,
            self.gradient_accumulation_steps, self.num_train_epochs, self.max_train_updates, self.dataloader_num_workers,
            SplitSettings(
                self.validation_loss_percent if validating else 0.0,
                self.validation_image_percent if self.validation_image else 0.0,
                self.max_validation_loss_items,
                self.max_validation_images,
            ),
        )

    def run_facts(self, world_size: int) -> RunFacts:
        return RunFacts(
            self.optimizer, self.weights_dtype, self.use_ema, self.train_text_encoder, self.frozen_text_encoder(),
            self.train_batch_size * world_size, self.gradient_accumulation_steps,
        )

    def sampling_scheduler_overrides(self) -> dict:
        """The sampling scheduler must follow the training objective (v-prediction, zero terminal SNR)."""
        overrides = {"prediction_type": self.prediction_type}
        if self.zero_terminal_snr:
            overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        return overrides

    def evaluation_settings(self) -> EvaluationSettings:
        return EvaluationSettings(
            GenerationSettings(self.num_inference_steps, self.guidance_scale),
            loss_schedule=Schedule(self.validation_loss, self.validation_loss_every_n_epochs),
            image_schedule=Schedule(self.validation_image, self.validation_image_every_n_epochs),
            sample_schedule=Schedule(self.save_samples, self.save_samples_every_n_epochs, self.start_save_samples_epoch),
            every_n_updates=self.validation_every_n_updates,
            num_epochs=None if self.max_train_updates else self.num_train_epochs,  # with --max_train_updates the run validates at its end
            metric_weights=MetricWeights(self.inception_weights, self.lpips_weights, self.hpsv2_checkpoint),
            metrics=self.validation_metrics,
            source_dirs=self.validation_source_dirs,
            sample_prompts_file=self.sample_prompts,
            num_sample_images=self.num_sample_images,
            sample_size=self.max_resolution,
        )

    def export_settings(self, vae_name_or_path: str | None) -> ExportSettings:
        return ExportSettings(
            self.pretrained_model_name_or_path, self.single_file_config, vae_name_or_path, self.sampling_scheduler_overrides(), self.save_diffusers,
            self.save_single_file, self.save_precision, self.project_name, self.save_model_every_n_epochs, self.start_save_model_epoch,
        )

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


def with_cache_settings(config: TrainConfig) -> tuple[TrainConfig, CacheCheck]:
    """The run's config: a copy with what the flags leave unset (model, resolution range) taken from the
    caches (the parsed config is not changed), and what the cache check found (cache.check_caches)."""
    caches = check_caches(config.cached_dataset_dirs, config.cache_requirements())
    return dataclasses.replace(config, **caches.taken), caches


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


def memory_settings(config: TrainConfig) -> list[EstimateSettings]:
    """The per-GPU loads of this configuration that --estimate_memory judges, for config.estimate_gpus GPUs
    (0: this machine's). With --gradient_reduction auto and accumulation, cards under 40 GB reduce every
    microbatch and larger ones once per update (reduce_every_microbatch): both loads, every microbatch first."""
    from sdxl_trainer.tools.memory_estimate import EstimateSettings  # torch's memory trackers: only here

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
