"""sdxl_extract_lora.py's configuration: the base and fine-tuned models, the LoRA's ranks and file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from sdxl_trainer.config import option
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE, model_location_problem


@dataclass
class ExtractConfig:
    base: str = option(help="the model the fine-tune started from: diffusers folder, single-file .safetensors or Hugging Face model id")
    tuned: str = option(help="the fine-tuned model (e.g. OUTPUT_DIR/PROJECT_NAME/pipeline or pipeline.safetensors), same kinds as --base")
    output: Path = option(help="LoRA file to write (.safetensors)")
    rank: int = option(help="rank (kohya's network_dim) of the Linear and 1x1-convolution layers: higher keeps more of the fine-tune, in a larger file")
    conv_rank: int = option(
        0, help="rank of the 3x3 convolutions (kohya's conv_dim); above 0 it also adds the ResNet blocks and up/downsamplers; 0 = transformer blocks only"
    )
    min_diff: float = option(
        0.01, help="a text encoder whose largest weight change is at most this is left out (not trained, or changed only by rounding); kohya's default"
    )
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the LoRA's weights")
    device: str = option("cpu", help="where the SVDs run, one layer at a time: cpu, or cuda for a GPU (much faster for SDXL)")
    single_file_config: str = option(
        SDXL_CONFIG_SOURCE, help="diffusers config (model id or folder) describing a single-file --base or --tuned: architecture and tokenizers"
    )

    def validate(self) -> list[str]:
        problems = [problem for flag in ("base", "tuned") if (problem := model_location_problem(getattr(self, flag), f"--{flag}"))]
        if self.output.suffix != ".safetensors":
            problems.append(f"--output must end in .safetensors, got {self.output}")
        if self.rank < 1:
            problems.append("--rank must be at least 1")
        if self.conv_rank < 0:
            problems.append("--conv_rank must be >= 0 (0 leaves the ResNet convolutions out)")
        if self.min_diff < 0:
            problems.append("--min_diff must be >= 0")
        try:
            torch.device(self.device)
        except RuntimeError:
            problems.append(f"--device {self.device!r} is not a device (cpu, cuda, cuda:1...)")
        return problems
