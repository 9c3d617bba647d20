"""Writing the trained model out as a diffusers pipeline folder and, optionally, one single-file checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .single_file import SDXL_CONFIG_SOURCE, load_pipeline, save_single_file

SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def save_pipeline(
    unet_state_dict: dict[str, torch.Tensor],
    base_model: str,
    output_dir: Path,
    save_precision: str,
    scheduler_overrides: dict | None = None,
    single_file_config: str = SDXL_CONFIG_SOURCE,
    single_file: Path | None = None,
) -> Path:
    """Save base_model's pipeline with the trained UNet weights into output_dir (rank 0 only), and into
    the single-file checkpoint `single_file` if given. A single-file base_model is read with
    single_file_config describing it.

    scheduler_overrides change the sampling scheduler's config where training changed the model's
    objective (v-prediction, zero terminal SNR), so the exported pipeline samples correctly as it is.

    Written to a temporary sibling folder and renamed, so an interrupted export never leaves a folder
    that looks complete; an older export at output_dir is replaced only once the new one is whole."""
    pipeline = load_pipeline(base_model, single_file_config, SAVE_DTYPES[save_precision])
    pipeline.unet.load_state_dict(unet_state_dict, strict=True)  # copies (and casts) into the base weights
    if scheduler_overrides:
        pipeline.scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config, **scheduler_overrides)
    tmp_dir = output_dir.with_name(f".{output_dir.name}.tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    pipeline.save_pretrained(tmp_dir)
    if output_dir.exists():
        old_dir = output_dir.with_name(f".{output_dir.name}.old")
        shutil.rmtree(old_dir, ignore_errors=True)
        output_dir.rename(old_dir)
        tmp_dir.rename(output_dir)
        shutil.rmtree(old_dir)
    else:
        tmp_dir.rename(output_dir)
    if single_file is not None:
        save_single_file(pipeline, single_file)
    return output_dir
