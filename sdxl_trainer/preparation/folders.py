"""Finding image + caption pairs (and mask files) in a data folder.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sdxl_trainer.preparation.images import (
    IMAGE_EXTENSIONS,
)
from sdxl_trainer.preparation.scan import DataScan, ScanProblem, SourcePair

MASK_SUFFIX = ".mask"  # photo.mask.png beside photo.jpg: photo's loss mask (--mask_files), never an image of its own


def _image_rank(name: str) -> tuple[int, str]:
    """Which of several images with one name gets the caption: the first extension of IMAGE_EXTENSIONS."""
    return IMAGE_EXTENSIONS.index(Path(name).suffix.lower()), name


def scan_images(data_dir: Path) -> DataScan:
    """Every image under data_dir (recursively, hidden names skipped, symlinked folders followed once) with its
    caption: the .txt file of the same name, in any case (photo.JPG + photo.TXT). What looks like data but
    cannot be used is listed, not dropped: dangling or looping symlinks, FIFOs and other non-files named like
    images, folders named like images, folders that cannot be listed, and images that share one name
    (a.jpg + a.png + a.txt: the first extension of IMAGE_EXTENSIONS gets the caption). An image named
    name.mask.<image extension> is the loss mask of image `name` (used with --mask_files), not an image."""
    pairs: list[SourcePair] = []
    problems: list[ScanProblem] = []
    visited: set[Path] = set()
    pending = [data_dir]
    while pending:
        folder = pending.pop()
        relative_folder = folder.relative_to(data_dir)
        real = folder.resolve()
        if real in visited:
            continue
        visited.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as error:
            problems.append(ScanProblem((relative_folder.as_posix() or "."), f"cannot list this folder ({error.strerror}): its images are not cached; fix its permissions", "unreadable folder"))
            continue
        images: dict[str, list[str]] = {}
        masks: dict[str, list[str]] = {}
        captions: dict[str, str] = {}
        for entry in entries:
            if entry.name.startswith("."):
                continue
            relative = (relative_folder / entry.name).as_posix()
            looks_like_image = Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS
            try:
                mode = os.stat(entry.path).st_mode  # follows symlinks
            except OSError as error:
                problems.append(ScanProblem(relative, f"broken symlink ({error.strerror}): point it at an existing file or remove it", "broken symlink"))
                continue
            if stat.S_ISDIR(mode):
                if looks_like_image:
                    problems.append(ScanProblem(relative, "a folder named like an image (its contents are scanned as a folder)", "not a file"))
                pending.append(Path(entry.path))
            elif not stat.S_ISREG(mode):
                if looks_like_image:
                    problems.append(ScanProblem(relative, "not a regular file (a FIFO, socket or device)", "not a file"))
            elif looks_like_image:
                stem = Path(entry.name).stem
                if Path(stem).suffix.lower() == MASK_SUFFIX:
                    masks.setdefault(Path(stem).stem, []).append(entry.name)
                else:
                    images.setdefault(stem, []).append(entry.name)
            elif Path(entry.name).suffix.lower() == ".txt":
                stem = Path(entry.name).stem
                captions[stem] = min(captions.get(stem, entry.name), entry.name, key=lambda name: (name != f"{stem}.txt", name))
        for stem, names in images.items():
            chosen, *others = sorted(names, key=_image_rank)
            caption = captions.get(stem)
            mask = min(masks.pop(stem, []), key=_image_rank, default=None)
            pairs.append(
                SourcePair(folder / chosen, (relative_folder / chosen).as_posix(), folder / caption if caption else None, mask_path=folder / mask if mask else None)
            )
            for other in others:
                problems.append(ScanProblem(
                    (relative_folder / other).as_posix(),
                    f"another image has the same name ({chosen}) and takes its caption: rename this one and give it its own caption",
                    "duplicate name",
                ))
        for names in masks.values():  # masks left over: no image of their name
            for name in names:
                problems.append(ScanProblem((relative_folder / name).as_posix(), "a mask file without an image of its name: rename it after its image (photo.jpg -> photo.mask.png)", "mask without image"))
    pairs.sort(key=lambda pair: pair.relative_path)
    problems.sort(key=lambda problem: problem.relative_path)
    return DataScan(pairs, problems)
