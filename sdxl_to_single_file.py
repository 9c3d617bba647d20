"""Convert an SDXL diffusers pipeline folder (for example a run's OUTPUT_DIR/PROJECT_NAME/pipeline) into
one single-file .safetensors checkpoint in the layout A1111, ComfyUI, Forge and kohya load.

    venv/bin/python sdxl_to_single_file.py --pipeline output/my_run/pipeline --output my_run.safetensors
"""

from __future__ import annotations

import sys

from sdxl_trainer.config import parse_config
from sdxl_trainer.jobs.convert_config import ConvertConfig
from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE, load_pipeline, save_single_file
from sdxl_trainer.outputs.export import SAVE_DTYPES
from sdxl_trainer.runtime.quiet_libraries import hide_library_progress_bars


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ConvertConfig, argv, description=__doc__)
    hide_library_progress_bars()
    pipeline = load_pipeline(str(config.pipeline), SDXL_CONFIG_SOURCE, SAVE_DTYPES[config.save_precision])
    print(f"Wrote {save_single_file(pipeline, config.output, title=config.output.stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
