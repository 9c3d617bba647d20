"""What the trainer runs before training (the base model) and after epochs: validation loss, validation
images with their metrics, and a row of the sample grid.

The validation loss runs on the sharded training UNet itself (no extra memory). Images need the whole
UNet on every process: it is gathered on rank 0 (the EMA weights with --use_ema, as exported) and handed
to every process through a RAM-disk folder (handoff.py), with the base pipeline's VAE and text encoders
around it (the trained encoders with --train_text_encoder, which then also encode the captions, the
empty negative and, for the validation loss, the held-out captions); the copy is dropped as soon as the
images are made.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from sdxl_trainer.config import option
from sdxl_trainer.distributed.world import World
from sdxl_trainer.evaluation.handoff import PipelineHandoff
from sdxl_trainer.evaluation.metrics import METRICS, MetricWeights, MetricWeightsError, load_image_metrics
from sdxl_trainer.evaluation.sample_grid import append_grid_row, is_due
from sdxl_trainer.evaluation.sample_prompts import DEFAULT_SAMPLE_PROMPTS, SamplePrompt, choose_sample_prompts, column_seeds, read_prompts
from sdxl_trainer.evaluation.sampling import GenerationSettings, ImageRequest, gather_images, generate, rank_share
from sdxl_trainer.evaluation.validation import ImageValidator, validation_loss
from sdxl_trainer.models.encoders import CaptionEmbeddings, encode_prompts
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter
from sdxl_trainer.training.captions import StepCaptionEncoder
from sdxl_trainer.training.dataset import CachedDataset
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.holdout import Holdout
from sdxl_trainer.training.trained_models import TrainedModels

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import DDPMScheduler

SAMPLE_GRID_FILE = Path("samples") / "sample_grid.png"  # inside the run folder


@dataclass(kw_only=True)
class EvaluationOptions:
    """Validation and sample images"""

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

    def problems(self) -> list[str]:
        problems = []
        for name in ("num_sample_images", "num_inference_steps"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        for name in ("validation_loss_percent", "validation_image_percent"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"--{name} is a share between 0 and 1 (0.1 = 10%), got {getattr(self, name)}")
        unknown_metrics = set(self.validation_metrics or ()) - set(METRICS)
        if unknown_metrics:
            problems.append(f"--validation_metrics: unknown {sorted(unknown_metrics)}; choose from {METRICS}")
        if not self.sample_prompts.is_file():
            problems.append(f"--sample_prompts {self.sample_prompts} does not exist")
        elif self.save_samples:
            try:
                read_prompts(self.sample_prompts)
            except ValueError as error:
                problems.append(f"--sample_prompts: {error}")
        for name in ("validation_loss_every_n_epochs", "validation_image_every_n_epochs", "save_samples_every_n_epochs", "max_validation_loss_items",
                     "max_validation_images", "validation_every_n_updates"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0 (0 turns it off)")
        if self.guidance_scale < 0:
            problems.append(f"--guidance_scale must be >= 0, got {self.guidance_scale}")
        return problems


@dataclass(frozen=True)
class Schedule:
    """Every N epochs (0 = only before training); epoch 0 is the base model. Off = never."""

    enabled: bool
    every_n_epochs: int
    start_epoch: int = 0

    def due(self, epochs_done: int, num_epochs: int | None) -> bool:
        return self.enabled and is_due(epochs_done, self.every_n_epochs, self.start_epoch, num_epochs)


@dataclass(frozen=True)
class PipelineSource:
    """Where the inference pipeline around the trained UNet comes from, and how it samples."""

    base_model: str
    single_file_config: str
    dtype: torch.dtype
    scheduler_overrides: dict
    handoff_root: Path | None
    run_name: str
    vae_name_or_path: str | None = None  # the VAE the caches were encoded with, where it is not the model's own


@dataclass(frozen=True)
class EvaluationSettings:
    """The run's validation and sample-grid flags (--validation_*, --save_samples*, the metric weights)."""

    generation: GenerationSettings
    loss_schedule: Schedule
    image_schedule: Schedule
    sample_schedule: Schedule
    every_n_updates: int  # --validation_every_n_updates: everything that is on (0 = off)
    num_epochs: int | None  # None: no last epoch (--max_train_updates ends the run)
    metric_weights: MetricWeights
    metrics: list[str] | None  # --validation_metrics (None: every metric whose weights are here)
    source_dirs: list[str] | None  # --validation_source_dirs
    sample_prompts_file: str | None  # --sample_prompts (None: the built-in prompts)
    num_sample_images: int
    sample_size: int  # the side of a sample whose prompt sets no size


def build_evaluator(settings: EvaluationSettings, world: World, run_dir: Path, dataset: CachedDataset, holdout: Holdout, noise_scheduler: DDPMScheduler,
                    negative: tuple[torch.Tensor, torch.Tensor], source: PipelineSource, seed: int, caption_chunks: int,
                    trained_caption_encoder: StepCaptionEncoder | None) -> Evaluator:
    """The run's Evaluator. Metric networks load here, once per run; a metric whose weights are missing is
    said once (rank 0) and turned off, unless it was asked for by name."""
    validator = None
    if settings.image_schedule.enabled and len(holdout.image_items):
        weights = settings.metric_weights
        named_weights = {"fid", "kid", "is"} if weights.inception else set()
        named_weights |= {"lpips"} if weights.lpips else set()
        named_weights |= {"hpsv2"} if weights.hpsv2 else set()
        try:
            metrics = load_image_metrics(
                weights,
                wanted=settings.metrics or METRICS,
                required=set(settings.metrics or ()) | named_weights,
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
            validator = ImageValidator(dataset, holdout.image_items, metrics, holdout.seed, world.device, settings.generation, settings.source_dirs)
        elif world.is_main:
            print("Warning: no image metric has its weights here, so validation images are not generated (see the warnings above).")
    prompts = []
    if settings.sample_schedule.enabled:
        file_prompts, notes = read_prompts(settings.sample_prompts_file)
        if world.is_main:
            for note in notes:
                print(f"Note: {note}")
        prompts = choose_sample_prompts(file_prompts, dataset.captions(), settings.num_sample_images, seed)
    held_out = HeldOutData(dataset, holdout, noise_scheduler, negative)
    samples = SampleColumns(prompts, column_seeds(prompts, seed), settings.sample_size, run_dir / SAMPLE_GRID_FILE)
    return Evaluator(settings, world, held_out, source, validator, samples, caption_chunks, trained_caption_encoder)


@dataclass(frozen=True)
class HeldOutData:
    """What validation works on: the dataset with its held-out items, the noise schedule, and the empty
    prompt's embeddings (the negative of every generated image)."""

    dataset: CachedDataset
    holdout: Holdout
    noise_scheduler: DDPMScheduler
    negative: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SampleColumns:
    """The sample grid's columns: their prompts and seeds, the side of a column whose prompt sets no size, the grid's file."""

    prompts: list[SamplePrompt]
    seeds: list[int]
    size: int
    grid_path: Path


class Evaluator:
    """Decides and runs what is due before training, after an update, at an epoch's end and at the run's end:
    the validation loss, validation images with their metrics, and the sample grid's next row."""

    def __init__(self, settings: EvaluationSettings, world: World, held_out: HeldOutData, source: PipelineSource, validator: ImageValidator | None,
                 samples: SampleColumns, caption_chunks: int, trained_caption_encoder: StepCaptionEncoder | None = None):
        """caption_chunks: the caches' caption length in chunks of 75 tokens; sample prompts (and their negative
        prompts) are encoded with the same rule (encoding.encode_prompts). trained_caption_encoder
        (--train_text_encoder): validation then encodes captions with the trained encoders instead of reading
        the cached embeddings."""
        self.settings = settings
        self.world = world
        self.held_out = held_out
        self.source = source
        self.image_schedule = settings.image_schedule if validator is not None and len(held_out.holdout.image_items) else Schedule(False, 0)
        self.validator = validator
        self.samples = samples
        self.caption_chunks = caption_chunks
        self.trained_caption_encoder = trained_caption_encoder

    def before_training(self, models: TrainedModels, ema: ShardedEMA | None, metrics: MetricsWriter, update: int) -> None:
        """Collective: the base model's scores and sample row (epoch 0 of every schedule)."""
        self._run_and_report(0, models, ema, metrics, update)

    def after_update(self, update: int, finished_epochs: int | None, run_ends: bool, models: TrainedModels, ema: ShardedEMA | None,
                     metrics: MetricsWriter) -> None:
        """Collective, after every update: everything that is on every --validation_every_n_updates updates, and
        at an epoch's end (finished_epochs) what the epoch schedules ask. A run without a last epoch
        (--max_train_updates) validates at its end instead (at_run_end)."""
        if self._every_n_updates_due(update):
            self._run_and_report(None, models, ema, metrics, update)
        if finished_epochs is not None and not (self.settings.num_epochs is None and run_ends):
            self._run_and_report(finished_epochs, models, ema, metrics, update)

    def at_run_end(self, update: int, models: TrainedModels, ema: ShardedEMA | None, metrics: MetricsWriter) -> None:
        """Collective: a --max_train_updates run ends inside an epoch or at an epoch's end without its own
        validation, so what is exported is validated here (unless every N updates just did)."""
        if self.settings.num_epochs is None and not self._every_n_updates_due(update):
            self._run_and_report(None, models, ema, metrics, update)

    def _every_n_updates_due(self, update: int) -> bool:
        every = self.settings.every_n_updates
        return bool(every) and update % every == 0

    def _run_and_report(self, epochs_done: int | None, models: TrainedModels, ema: ShardedEMA | None, metrics: MetricsWriter, update: int) -> None:
        """Collective: what is due after `epochs_done` epochs, or everything that is on (None: every N
        updates, or the end of a --max_train_updates run), logged at `update` and printed on one line."""
        started = time.perf_counter()
        schedules = (self.settings.loss_schedule, self.image_schedule, self.settings.sample_schedule)
        if epochs_done is None:
            due, label = [schedule.enabled for schedule in schedules], f"update {update}"
        else:
            due = [schedule.due(epochs_done, self.settings.num_epochs) for schedule in schedules]
            label = "base" if epochs_done == 0 else f"epoch {epochs_done}"
        scores = self._run(*due, label, models, ema, metrics, update)
        if scores and self.world.is_main:
            what = f"after update {update}" if epochs_done is None else "base model" if epochs_done == 0 else f"after epoch {epochs_done}"
            numbers = ", ".join(f"{tag.removeprefix('val/')} {value:.4g}" for tag, value in scores.items())
            tqdm.write(f"Validation ({what}, {time.perf_counter() - started:.1f} s): {numbers}")

    def _run(self, loss_due: bool, images_due: bool, samples_due: bool, label: str, models: TrainedModels, ema: ShardedEMA | None,
             metrics: MetricsWriter, step: int) -> dict[str, float]:
        scores: dict[str, float] = {}
        held_out = self.held_out
        if loss_due and len(held_out.holdout.loss_items):
            def loss() -> dict[str, float]:
                encode = self.trained_caption_encoder.first_captions if self.trained_caption_encoder else None
                return validation_loss(
                    models.unet, held_out.dataset, held_out.holdout.loss_items, held_out.noise_scheduler, held_out.holdout.seed, self.world.device,
                    encode_batch=encode,
                )

            # Of the weights the optimizer has for evaluation (schedule-free AdamW's average; the trained ones otherwise).
            with models.evaluation_weights_in_model():
                if ema is None:
                    scores.update(loss())
                else:
                    # val/loss is that of the weights that are exported and sampled from: the EMA's.
                    with ema.weights_in_model():
                        scores.update(loss())
                    scores["val/loss_raw"] = loss()["val/loss"]
        if images_due or samples_due:
            state = models.exported_weights_on_rank0(ema, self.world.is_main)
            source = self.source
            with PipelineHandoff(
                source.handoff_root, source.run_name, source.base_model, source.single_file_config, self.world.device, source.dtype, source.vae_name_or_path
            ) as handoff:
                pipeline = handoff.pipeline(state)
                del state
                if source.scheduler_overrides:
                    pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, **source.scheduler_overrides)
                pipeline.set_progress_bar_config(disable=True)
                # Trained text encoders encode the captions and the empty negative as the exported pipeline will.
                encode = partial(self._encode, pipeline) if models.trains_text_encoders else None
                negative = held_out.negative
                if encode is not None:
                    empty = encode([""])
                    negative = (empty.prompt_embeds[0], empty.pooled_prompt_embeds[0])
                if images_due:
                    scores.update(self.validator(pipeline, negative, encode))
                if samples_due:
                    self._add_sample_row(pipeline, negative, label, metrics, step)
                del pipeline
            if self.world.device.type == "cuda":
                torch.cuda.empty_cache()
        metrics.scalars(scores, step)
        return scores

    @torch.no_grad()
    def _encode(self, pipeline, captions: list[str]) -> CaptionEmbeddings:
        """Captions through the pipeline's text encoders, by the caches' chunk rule."""
        return encode_prompts(
            (pipeline.tokenizer, pipeline.tokenizer_2), (pipeline.text_encoder, pipeline.text_encoder_2), captions, self.caption_chunks, self.world.device
        )

    def _sample_requests(self, pipeline, negative: tuple[torch.Tensor, torch.Tensor]) -> list[ImageRequest]:
        """One request per sample column, in column order, with the options its prompt line set."""
        prompts = self.samples.prompts
        captions = self._encode(pipeline, [prompt.text for prompt in prompts])
        negative_texts = sorted({prompt.negative for prompt in prompts if prompt.negative is not None})
        encoded = self._encode(pipeline, negative_texts) if negative_texts else None
        negatives = {text: (encoded.prompt_embeds[i].cpu(), encoded.pooled_prompt_embeds[i].cpu()) for i, text in enumerate(negative_texts)}
        return [
            ImageRequest(
                position, captions.prompt_embeds[position].cpu(), captions.pooled_prompt_embeds[position].cpu(),
                prompt.width or self.samples.size, prompt.height or self.samples.size, seed,
                prompt.steps, prompt.guidance_scale, negatives.get(prompt.negative, negative),
            )
            for position, (prompt, seed) in enumerate(zip(prompts, self.samples.seeds))
        ]

    def _add_sample_row(self, pipeline, negative: tuple[torch.Tensor, torch.Tensor], label: str, metrics: MetricsWriter, step: int) -> None:
        requests = self._sample_requests(pipeline, negative)
        mine = rank_share(requests, self.world.rank, self.world.world_size)
        images = gather_images(generate(pipeline, mine, self.settings.generation, negative, self.world.device), self.world.device)
        if self.world.is_main:
            header_and_row = append_grid_row(
                self.samples.grid_path, [images[position] for position in range(len(requests))], label, [prompt.text for prompt in self.samples.prompts],
                options=[prompt.options_text() for prompt in self.samples.prompts],
            )
            metrics.image("samples/grid", np.asarray(header_and_row), step)
        dist.barrier()
