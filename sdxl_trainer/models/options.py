"""The SDXL model a script works on: one definition for the caching script and the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from sdxl_trainer.config import option
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE


@dataclass(kw_only=True)
class ModelOptions:
    """The SDXL model"""

    pretrained_model_name_or_path: str | None = option(
        None,
        help="SDXL model: hub id, local diffusers folder, or single-file .safetensors (A1111/ComfyUI layout). Caching: its text encoders "
        f"and VAE encode the data; None = {SDXL_CONFIG_SOURCE}. Training: the model to fine-tune, which must be the one the caches were made "
        "with; None = that one, as their cache_info.json names it",
    )
    single_file_config: str = option(
        SDXL_CONFIG_SOURCE, help="diffusers config (hub id or folder) describing a single-file --pretrained_model_name_or_path; only its config files are read"
    )


