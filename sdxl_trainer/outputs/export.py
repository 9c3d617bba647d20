"""Writing the trained model out as a diffusers pipeline folder and, optionally, one single-file checkpoint;
and when a run exports (after epochs, at its end). Saving the training state is the checkpointer's."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sdxl_trainer.config import option
from sdxl_trainer.distributed.world import World, broadcast_text
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES, ComponentWeights, text_encoder_label
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE, hf_clip_names, load_pipeline, save_single_file
from sdxl_trainer.runtime.files import make_shareable, write_error_reason

SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HUB_CACHE_PREFIX = "models--"  # a model's folder in the Hugging Face cache: models--ORG--NAME

@dataclass(kw_only=True)
class ExportOptions:
    """Exported models"""

    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the exported models")
    save_diffusers: bool = option(True, help="export the trained pipeline: OUTPUT_DIR/PROJECT_NAME/pipeline at the end, pipeline_epoch_NNNN at epoch saves")
    save_single_file: bool = option(
        False,
        help="also export each model as one SDXL .safetensors file (A1111 / ComfyUI / kohya layout) beside the pipeline, with its scheduler config "
        "for diffusers; with --no-save_diffusers, only those",
    )
    save_model_every_n_epochs: int = option(1, help="export the model (and save state, with --save_state) after every N epochs; 0 = only at the end")
    start_save_model_epoch: int = option(1, help="first epoch (counting from 1) after which the epoch saves happen")

    def problems(self) -> list[str]:
        problems = []
        if self.start_save_model_epoch < 1:
            problems.append("--start_save_model_epoch must be at least 1")
        if self.save_model_every_n_epochs < 0:
            problems.append("--save_model_every_n_epochs must be >= 0 (0 turns it off)")
        return problems


class ExportError(RuntimeError):
    """The model could not be written; the message names the place and the reason, and nothing there was replaced."""


@dataclass(frozen=True)
class ExportSettings:
    """What the exported model is made of and when it is written (--save_diffusers, --save_single_file,
    --save_precision, --save_model_every_n_epochs)."""

    base_model: str
    single_file_config: str
    vae_name_or_path: str | None  # the VAE the caches were encoded with, where it is not the model's own
    scheduler_overrides: dict
    save_diffusers: bool
    save_single_file: bool
    save_precision: str
    run_name: str  # --project_name: the model's title
    every_n_epochs: int  # 0 = no epoch saves
    start_epoch: int


class Exporter:
    """Writes the trained model (EMA weights with an EMA) from a running job: after epochs and at its end."""

    def __init__(self, settings: ExportSettings, world: World, gather_weights: Callable[[], ComponentWeights], ema_unet: bool, run_dir: Path):
        """gather_weights: collective, the trained weights in rank 0's CPU memory (TrainedModels.exported_weights_on_rank0);
        ema_unet: its UNet's are the EMA's."""
        self.settings = settings
        self.world = world
        self.gather_weights = gather_weights
        self.ema_unet = ema_unet
        self.run_dir = run_dir

    @property
    def enabled(self) -> bool:
        return self.settings.save_diffusers or self.settings.save_single_file

    def export(self, pipeline_dir: Path) -> None:
        """Collective: gather the trained UNet (EMA weights with --use_ema) and text encoders (with
        --train_text_encoder) on rank 0 and write the pipeline (and the single-file checkpoint beside it with
        --save_single_file). Raises ExportError on every rank if the export failed; nothing at pipeline_dir is
        replaced then."""
        settings = self.settings
        weights = self.gather_weights()
        failure = ""
        if self.world.is_main:
            started = time.perf_counter()
            folder = pipeline_dir if settings.save_diffusers else None
            single_file = pipeline_dir.with_suffix(".safetensors") if settings.save_single_file else None
            # The run's name, and for an epoch save also its epoch: "my_run", "my_run_epoch_0003".
            title = settings.run_name + pipeline_dir.name.removeprefix("pipeline")
            try:
                save_pipeline(
                    weights, settings.base_model, folder, settings.save_precision, settings.scheduler_overrides, settings.single_file_config,
                    single_file, settings.vae_name_or_path, model_title=title,
                )
                encoders = [text_encoder_label(name) for name in TEXT_ENCODER_NAMES if name in weights]
                what = " and ".join(["EMA UNet" if self.ema_unet else "UNet", *encoders])
                written = " and ".join(str(path) for path in (folder, single_file) if path is not None)
                tqdm.write(f"Saved the trained model ({what}, {settings.save_precision}) to {written} in {time.perf_counter() - started:.1f} s.")
            except ExportError as error:
                failure = str(error)
        failure = broadcast_text(failure, self.world.device)
        if failure:
            raise ExportError(failure)

    def epoch_save_due(self, finished_epochs: int) -> bool:
        """Epoch saves (the exported model and the state) after every --save_model_every_n_epochs epochs."""
        every = self.settings.every_n_epochs
        return bool(every) and finished_epochs >= self.settings.start_epoch and finished_epochs % every == 0

    def export_epoch(self, finished_epochs: int, say: Callable[[str], None]) -> None:
        """Collective: an epoch save's export; if it fails (a full disk), training goes on."""
        if not self.enabled:
            return
        try:
            self.export(self.run_dir / f"pipeline_epoch_{finished_epochs:04d}")
        except ExportError as error:
            say(f"Warning: {error} Training goes on.")

    def export_final(self) -> None:
        """Collective: the run's model at its end, into OUTPUT_DIR/PROJECT_NAME/pipeline."""
        if self.enabled:
            self.export(self.run_dir / "pipeline")


def known_model_name(name_or_path: str) -> str:
    """A model as users know it: a Hugging Face model id as it is, a local file or folder by its name, a folder
    of the Hugging Face cache (.../models--ORG--NAME/snapshots/REVISION) by its model id ORG/NAME."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return name_or_path
    path = Path(os.path.abspath(path))  # "." and a trailing slash named, symbolic links kept as the user named them
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith(HUB_CACHE_PREFIX):
        return path.parent.parent.name.removeprefix(HUB_CACHE_PREFIX).replace("--", "/", 1)
    return path.name


def save_pipeline(
    trained_weights: ComponentWeights,
    base_model: str,
    output_dir: Path | None,
    save_precision: str,
    scheduler_overrides: dict | None = None,
    single_file_config: str = SDXL_CONFIG_SOURCE,
    single_file: Path | None = None,
    vae_name_or_path: str | None = None,
    *,
    model_title: str,
) -> None:
    """Save base_model's pipeline with the trained weights (component name -> state dict: "unet", and the
    text encoders where they were trained) into the folder output_dir (None: no folder)
    and into the single-file checkpoint `single_file` if given (rank 0 only). A single-file base_model is
    read with single_file_config describing it; with vae_name_or_path, that VAE replaces the model's own
    (the one the training caches were encoded with, so latents and decoder agree). model_title names the
    model in the single file's metadata (`modelspec.title`, which UIs and model hubs show).

    scheduler_overrides change the sampling scheduler's config where training changed the model's
    objective (v-prediction, zero terminal SNR), so the exported pipeline samples correctly as it is.

    Written to a temporary sibling folder and renamed, so an interrupted export never leaves a folder
    that looks complete; an older export at output_dir is replaced only once the new one is whole. Weights that
    are not finite at save_precision are never written (ExportError naming the first such tensor)."""
    problem = non_finite_weights(trained_weights, save_precision)
    if problem:
        written = " and ".join(str(path) for path in (output_dir, single_file) if path is not None)
        raise ExportError(f"Not exporting the model to {written}: its weights are not finite. {problem}")
    pipeline = load_pipeline(base_model, single_file_config, SAVE_DTYPES[save_precision], vae_name_or_path)
    for name, state_dict in trained_weights.items():
        getattr(pipeline, name).load_state_dict(state_dict, strict=True)  # copies (and casts) into the base weights
    if scheduler_overrides:
        pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, **scheduler_overrides)
    # Caption dropout trained the encoded empty caption (as kohya, SimpleTuner and ComfyUI use it), so the
    # pipeline must encode "" too when no negative prompt is given, not substitute zeros (diffusers' default).
    pipeline.register_to_config(force_zeros_for_empty_prompt=False)
    # diffusers records where each part was loaded from: this machine's paths, which mean nothing to whoever
    # gets the export. Recorded instead: the names users know the base model (and a replaced VAE) by.
    for part, source in ((pipeline, base_model), (pipeline.unet, base_model), (pipeline.vae, vae_name_or_path or base_model)):
        part.register_to_config(_name_or_path=known_model_name(source))
    if output_dir is not None:
        _save_folder(pipeline, output_dir, fp16_variant=save_precision == "fp16")
    if single_file is not None:
        try:
            save_single_file(pipeline, single_file, model_title)
        except Exception as error:  # noqa: BLE001 - as below
            raise ExportError(f"Could not export the model to {single_file} ({write_error_reason(error, single_file.parent)}); nothing there was replaced.") from error


def non_finite_weights(trained_weights: ComponentWeights, save_precision: str) -> str:
    """The first trained tensor holding a value that is not finite once cast to save_precision, said with what
    to do about it; "" when every value is finite. A run whose weights diverged (an update that blew them up)
    would otherwise export NaN/inf over the last good export."""
    dtype = SAVE_DTYPES[save_precision]
    for component, state_dict in trained_weights.items():
        for name, tensor in state_dict.items():
            if not tensor.is_floating_point():
                continue
            exported = tensor.to(dtype)
            bad = int((~torch.isfinite(exported)).sum())
            if not bad:
                continue
            label = "UNet" if component == "unet" else text_encoder_label(component) if component in TEXT_ENCODER_NAMES else component
            count = f"all {tensor.numel():,}" if bad == tensor.numel() else f"{bad:,} of {tensor.numel():,}"
            found = f"{label} tensor {name}: {count} values are NaN or inf at {save_precision}"
            if torch.isfinite(tensor).all():  # the cast overflowed
                largest = float(tensor.abs().max())
                return (
                    f"{found} (its trained values are finite, up to {largest:.3g}, beyond {save_precision}'s largest "
                    f"({torch.finfo(dtype).max:.0f})). Nothing was written: export with --save_precision bf16 or fp32 if such values are "
                    "right (an SDXL model's weights stay far below), else they diverged: resume from an earlier checkpoint "
                    "(--load_saved_state) with a lower --learning_rate."
                )
            return (
                f"{found}. Training diverged; nothing was written, so the earlier export there is kept. Resume from a checkpoint "
                "saved before the divergence (--load_saved_state) with a lower --learning_rate."
            )
    return ""


def _save_folder(pipeline, output_dir: Path, fp16_variant: bool) -> None:
    tmp_dir = output_dir.with_name(f".{output_dir.name}.tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        pipeline.save_pretrained(tmp_dir)
        _write_slow_tokenizer_files(pipeline, tmp_dir)
        _write_text_encoder_with_standard_names(pipeline, tmp_dir)
        if fp16_variant:
            _link_fp16_variant(tmp_dir)
        make_shareable(tmp_dir)
    except Exception as error:  # diffusers passes safetensors' SafetensorError (not an OSError) for a full disk
        reason = write_error_reason(error, output_dir.parent)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ExportError(f"Could not export the model to {output_dir} ({reason}); nothing there was replaced.") from error
    if output_dir.exists():
        old_dir = output_dir.with_name(f".{output_dir.name}.old")
        shutil.rmtree(old_dir, ignore_errors=True)
        output_dir.rename(old_dir)
        tmp_dir.rename(output_dir)
        shutil.rmtree(old_dir)
    else:
        tmp_dir.rename(output_dir)


# What transformers 5 leaves out of a pipeline folder that transformers 4.x and diffusers 0.32 (kohya sd-scripts
# pins 4.54 and 0.32) need to load it.


def _write_slow_tokenizer_files(pipeline, folder: Path) -> None:
    """transformers 4.x loads the pipeline's CLIPTokenizers as its slow tokenizer, which reads vocab.json,
    merges.txt and special_tokens_map.json (never tokenizer.json); transformers 5 saves only tokenizer.json
    and tokenizer_config.json. The BPE model of the fast tokenizer writes the first two as 4.x does."""
    for name in ("tokenizer", "tokenizer_2"):
        tokenizer = getattr(pipeline, name)
        tokenizer.backend_tokenizer.model.save(str(folder / name))
        (folder / name / "special_tokens_map.json").write_text(json.dumps(tokenizer.special_tokens_map, indent=2) + "\n", encoding="utf-8")


def _write_text_encoder_with_standard_names(pipeline, folder: Path) -> None:
    """transformers 4.x's CLIPTextModel keeps its layers under `text_model.` and, given a file without that
    prefix, loads CLIP-L with random weights, only warning. transformers 5's CLIPTextModel dropped the wrapper
    and puts the prefix back on save only for a model it loaded from a file that had it: not for one that
    diffusers' single-file loader (or tiny_model.py) built. So write the names both versions read.
    (CLIPTextModelWithProjection kept its `text_model` attribute: text_encoder_2 is saved right.)"""
    weights = {name: tensor.contiguous() for name, tensor in hf_clip_names(pipeline.text_encoder.state_dict()).items()}
    save_file(weights, str(folder / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})


def _link_fp16_variant(folder: Path) -> None:
    """Loaders that ask diffusers for variant="fp16" (kohya's folder loader at fp16) read
    `unet/diffusion_pytorch_model.fp16.safetensors`, `text_encoder/model.fp16.safetensors`...; a load without
    a variant reads the plain names. Both names are hard links to the same bytes, so the variant costs no
    space (5 GB for SDXL's UNet otherwise); a copy where the file system has no hard links. Every SDXL
    component is one file in fp16 (the UNet is under diffusers' 10 GB shard size), so there is no shard
    index to rename."""
    for weights in folder.glob("*/*.safetensors"):
        variant = weights.with_suffix(".fp16.safetensors")
        try:
            os.link(weights, variant)
        except OSError:
            shutil.copyfile(weights, variant)
