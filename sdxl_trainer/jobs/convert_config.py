"""sdxl_to_single_file.py's configuration: the pipeline folder to convert and the file to write."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sdxl_trainer.config import NO_UPLOAD, option
from sdxl_trainer.models.single_file import SINGLE_FILE_WRITER
from sdxl_trainer.outputs.output_guard import replace_problem


@dataclass
class ConvertConfig:
    pipeline: Path = option(help="diffusers SDXL pipeline folder to convert")
    output: Path = option(help="single-file checkpoint to write (.safetensors), a local file", url_refusal=NO_UPLOAD)
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the weights in the file")
    overwrite: bool = option(
        False, help="replace an existing --output this tool did not write (another model, or one written before the tools marked their files); "
        "a file it wrote is replaced without it"
    )

    def validate(self) -> list[str]:
        problems = []
        if not (self.pipeline / "model_index.json").is_file():
            problems.append(f"--pipeline {self.pipeline} is not a diffusers pipeline folder (no model_index.json)")
        if self.output.suffix != ".safetensors":
            problems.append(f"--output must end in .safetensors, got {self.output}")
        if self.output.resolve().is_relative_to(self.pipeline.resolve()):  # its weights, or a file loaders would find in the model
            problems.append(f"--output {self.output} is inside --pipeline {self.pipeline}, which it converts: write the file outside the pipeline folder")
        elif problem := replace_problem(self.output, SINGLE_FILE_WRITER, self.overwrite):
            problems.append(problem)
        return problems
