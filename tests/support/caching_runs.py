"""An image folder made for a test, and the caching script run on it in this process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import process_data_dir
from PIL import Image

RESOLUTION_FLAGS = ["--min_resolution", "256", "--max_resolution", "320"]


def make_dataset(folder: Path, count: int, size: tuple[int, int] = (256, 256), prefix: str = "img") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB").save(folder / f"{prefix}{index:03d}.png")
        (folder / f"{prefix}{index:03d}.txt").write_text(f"picture number {index}")
    return folder


def run_cache(data_dir: Path, cache_dir: Path, pipeline: Path, *extra: str) -> int:
    return process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline), *RESOLUTION_FLAGS, *extra]
    )
