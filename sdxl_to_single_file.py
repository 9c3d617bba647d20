"""Convert an SDXL diffusers pipeline folder (for example a run's OUTPUT_DIR/PROJECT_NAME/pipeline) into
one single-file .safetensors checkpoint in the layout A1111, ComfyUI, Forge and kohya load.

    venv/bin/python sdxl_to_single_file.py --pipeline output/my_run/pipeline --output my_run.safetensors
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sdxl_trainer.config import option, parse_config
from sdxl_trainer.export import SAVE_DTYPES
from sdxl_trainer.library_noise import hide_library_progress_bars
from sdxl_trainer.single_file import SDXL_CONFIG_SOURCE, load_pipeline, save_single_file


@dataclass
class ConvertConfig:
    pipeline: Path = option(help="diffusers SDXL pipeline folder to convert")
    output: Path = option(help="single-file checkpoint to write (.safetensors)")
    save_precision: Literal["fp16", "bf16", "fp32"] = option("fp16", help="dtype of the weights in the file")

    def validate(self) -> list[str]:
        problems = []
        if not (self.pipeline / "model_index.json").is_file():
            problems.append(f"--pipeline {self.pipeline} is not a diffusers pipeline folder (no model_index.json)")
        if self.output.suffix != ".safetensors":
            problems.append(f"--output must end in .safetensors, got {self.output}")
        return problems


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ConvertConfig, argv, description=__doc__)
    hide_library_progress_bars()
    pipeline = load_pipeline(str(config.pipeline), SDXL_CONFIG_SOURCE, SAVE_DTYPES[config.save_precision])
    print(f"Wrote {save_single_file(pipeline, config.output, title=config.output.stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
