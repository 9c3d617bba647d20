"""The SDXL pipeline's components by name, as diffusers' StableDiffusionXLPipeline names its attributes."""

from __future__ import annotations

import torch

TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2")  # CLIP ViT-L, OpenCLIP ViT-bigG

ComponentWeights = dict[str, dict[str, torch.Tensor]]  # pipeline component name -> its full state dict


def text_encoder_label(name: str) -> str:
    """"text encoder 1" for CLIP ViT-L (pipeline name "text_encoder"), "text encoder 2" for OpenCLIP bigG."""
    return f"text encoder {TEXT_ENCODER_NAMES.index(name) + 1}"
