"""Extract a LoRA from a fine-tune: the difference between the fine-tuned and the base SDXL model, factored
per layer by SVD, written in the kohya / A1111 LoRA layout that diffusers' `load_lora_weights`, ComfyUI,
A1111/Forge and kohya load (which layers and why: sdxl_trainer/lora_extract.py).

    venv/bin/python sdxl_extract_lora.py --base stabilityai/stable-diffusion-xl-base-1.0 \\
        --tuned output/my_run/pipeline --rank 32 --output my_run_lora.safetensors

--base and --tuned each take a diffusers folder, a single-file .safetensors (described by
--single_file_config) or a Hugging Face model id. Both models are held in CPU memory in fp32 (about 28 GB
for SDXL).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from sdxl_trainer.config import option, parse_config
from sdxl_trainer.export import SAVE_DTYPES
from sdxl_trainer.lora_extract import architecture_problem, extract_lora, lora_metadata, save_lora
from sdxl_trainer.single_file import SDXL_CONFIG_SOURCE, load_pipeline, model_location_problem


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


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ExtractConfig, argv, description=__doc__)
    base, tuned = (load_pipeline(model, config.single_file_config, torch.float32) for model in (config.base, config.tuned))
    problem = architecture_problem(base, tuned)
    if problem:
        raise SystemExit(f"Cannot extract a LoRA: {problem}.")
    extraction = extract_lora(base, tuned, config.rank, config.conv_rank, config.min_diff, SAVE_DTYPES[config.save_precision], torch.device(config.device))
    save_lora(extraction, lora_metadata(tuned, config.rank, config.conv_rank, config.output.stem), config.output)
    for component, report in extraction.components.items():
        print(f"{component}: {report.layers} layers; the LoRA keeps {report.kept:.1%} of their weight change (squared Frobenius norm)")
    for component, largest in extraction.skipped_text_encoders.items():
        print(f"{component}: left out, its largest weight change {largest:.3g} is at most --min_diff {config.min_diff:g}")
    if extraction.left_out:
        print("Largest weight changes no LoRA key carries (exporting at a lower precision alone changes weights by up to about 1e-3):")
        for name, change in extraction.left_out:
            print(f"  {name}: {change:.3g}")
    print(f"Wrote {config.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
