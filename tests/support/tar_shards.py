"""WebDataset tar shards made for a test, and the caching script run on them in this process.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from conftest import process_data_dir

from sdxl_trainer.preparation.folders import scan_images


def pack(tar_path: Path, members: list[tuple[str, bytes | Path]]) -> Path:
    """A tar holding `members` (name, contents or file to copy) in this order."""
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "w") as tar:
        for name, contents in members:
            data = contents.read_bytes() if isinstance(contents, Path) else contents
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tar_path


def sample_members(data_dir: Path) -> list[tuple[str, Path]]:
    """The image + caption pairs of a folder as WebDataset members (image, then its caption), in the folder
    scan's order."""
    members = []
    for pair in scan_images(data_dir).pairs:
        members += [(pair.relative_path, pair.image_path), (Path(pair.relative_path).with_suffix(".txt").as_posix(), pair.expected_caption)]
    return members


def cache_tars(data_dir: Path, cache_dir: Path, pipeline: Path, *extra: str) -> int:
    return process_data_dir(
        ["--data_dir", str(data_dir), "--tar_shards", "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline), *extra]
    )
