"""sdxl_extract_lora.py's configuration: the base and fine-tuned models, the LoRA's ranks and file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from huggingface_hub import try_to_load_from_cache

from sdxl_trainer.config import NO_UPLOAD, option
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE, hub_offline, is_single_file, model_location_problem
from sdxl_trainer.models.weight_files import CONFIG_FILES
from sdxl_trainer.outputs.lora_extract import LORA_WRITER
from sdxl_trainer.outputs.output_guard import replace_problem


@dataclass
class ExtractConfig:
    base: str = option(help="the model the fine-tune started from: diffusers folder, single-file .safetensors or Hugging Face model id")
    tuned: str = option(help="the fine-tuned model (e.g. OUTPUT_DIR/PROJECT_NAME/pipeline or pipeline.safetensors), same kinds as --base")
    output: Path = option(help="LoRA file to write (.safetensors), a local file; never one of the models, nor inside a model folder", url_refusal=NO_UPLOAD)
    rank: int = option(help="rank (kohya's network_dim) of the Linear and 1x1-convolution layers: higher keeps more of the fine-tune, in a larger file")
    conv_rank: int = option(
        0, help="rank of the 3x3 convolutions (kohya's conv_dim); above 0 it also adds the ResNet blocks and up/downsamplers; 0 = transformer blocks only"
    )
    min_diff: float = option(
        0.01, help="a text encoder whose largest weight change is at most this is left out (not trained, or changed only by rounding); kohya's default"
    )
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the LoRA's weights")
    overwrite: bool = option(
        False, help="replace an existing --output this tool did not write (a LoRA from elsewhere, or one written before the tools marked their "
        "files); a LoRA it wrote is replaced without it"
    )
    device: str = option(
        "auto", help="where each changed layer is factorised, one at a time: auto = the GPU when there is one (cuda), else cpu; or cpu, cuda, cuda:1..."
    )
    single_file_config: str | None = option(
        None,
        help="diffusers config (model id or folder; config files only) describing a single-file --base or --tuned: its architecture; "
        f"None = --base's own when --base is a diffusers folder or model id, else {SDXL_CONFIG_SOURCE}",
    )

    def config_source(self) -> str:
        """Where a single-file model's architecture is read from (single_file_config's help)."""
        if self.single_file_config:
            return self.single_file_config
        return SDXL_CONFIG_SOURCE if is_single_file(self.base) else self.base

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def validate(self) -> list[str]:
        problems = [problem for flag in ("base", "tuned") if (problem := model_location_problem(getattr(self, flag), f"--{flag}"))]
        if not problems:
            problems += self._config_problems() + self._output_problems()
        if self.output.suffix != ".safetensors":
            problems.append(f"--output must end in .safetensors, got {self.output}")
        if self.rank < 1:
            problems.append("--rank must be at least 1")
        if self.conv_rank < 0:
            problems.append("--conv_rank must be >= 0 (0 leaves the ResNet convolutions out)")
        if self.min_diff < 0:
            problems.append("--min_diff must be >= 0")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                problems.append(f"--device {self.device!r} is not a device (auto, cpu, cuda, cuda:1...)")
        return problems

    def _config_problems(self) -> list[str]:
        """A single file's architecture must be at hand: its config folder, or the hub model's configs in the cache."""
        single = next((flag for flag in ("base", "tuned") if is_single_file(getattr(self, flag))), None)
        if single is None:
            return []
        source = self.config_source()
        described = f"--{single} {getattr(self, single)} is a single file, whose architecture --single_file_config {source} describes"
        folder = Path(source).expanduser()
        if folder.is_dir():
            missing = [name for name in CONFIG_FILES.values() if not (folder / name).is_file()]
            return [f"{described}, but that folder has no {missing[0]}: give a diffusers folder of the same architecture"] if missing else []
        problem = model_location_problem(source, "--single_file_config")
        if problem and hub_offline() and not isinstance(try_to_load_from_cache(source, CONFIG_FILES["unet"]), str):
            return [
                f"{described}: that is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. Give --single_file_config a diffusers "
                "folder of the same architecture (the base model's folder, or any SDXL pipeline), or fetch its config files once (a few KB): "
                f"huggingface-cli download {source} --include '*.json'"
            ]
        return [problem] if problem else []

    def _output_problems(self) -> list[str]:
        """The LoRA must not replace a model it is made from (the same path, or the same file by another path or a
        hard link), nor land inside a model folder."""
        output = self.output.expanduser()
        problems = []
        for flag in ("base", "tuned"):
            given = getattr(self, flag)
            path = Path(given).expanduser()
            if not path.exists():  # a Hugging Face model id
                continue
            if path.is_dir():
                if output.resolve().is_relative_to(path.resolve()):
                    problems.append(f"--output {self.output} is inside the --{flag} model folder {given}, which the extraction reads: write the LoRA outside it")
            elif output.resolve() == path.resolve() or (output.exists() and os.path.samefile(output, path)):
                problems.append(f"--output {self.output} is the --{flag} file {given}: the LoRA would replace the model; choose another name")
        if not problems and (problem := replace_problem(output, LORA_WRITER, self.overwrite)):
            problems.append(problem)
        return problems
