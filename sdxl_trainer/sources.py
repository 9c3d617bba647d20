"""Finding image + caption pairs in a data folder and preparing each into a bucket-sized image."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from PIL import Image

from .buckets import Bucket, CropPlan, crop_into, micro_conditioning, plan_crop, upscale_target
from .cache import sha256_bytes
from .images import IMAGE_EXTENSIONS, UnreadableImage, decode_image_and_alpha, decode_mask, resize_and_crop, to_latent_mask, to_model_input

MASK_SUFFIX = ".mask"  # photo.mask.png beside photo.jpg: photo's loss mask (--mask_files), never an image of its own
# A mask whose aspect ratio is within this share of its image's is stretched to the image's size.
MASK_ASPECT_TOLERANCE = 0.01

if TYPE_CHECKING:
    from .tar_sources import TarMember

MaskFile = tuple[bytes, str]  # a mask file's bytes and their SHA-256 (read_mask_file)
# (image, factor) -> the image enlarged by at least factor, e.g. sdxl_trainer.upscale.Upscaler
UpscaleFunction = Callable[[Image.Image, float], Image.Image]


@dataclass(frozen=True)
class SourcePair:
    image_path: Path
    relative_path: str  # image path relative to the data folder, '/'-separated: the item's identity
    caption_path: Path | None = None  # found by the scan (any case of .txt); None = the image's name with .txt
    caption_text: str | None = None  # from a metadata table (metadata.py): used instead of a caption file
    table_size: tuple[int, int] | None = None  # (width, height) upright, as a metadata table states it: --dry_run trusts it
    mask_path: Path | None = None  # the image's loss mask file (name.mask.png), found by the scan
    tar_member: TarMember | None = None  # in a tar shard (tar_sources.py): the image's bytes are read from there, not image_path

    @property
    def expected_caption(self) -> Path:
        return self.caption_path or self.image_path.with_suffix(".txt")


@dataclass
class PreparedItem:
    source: SourcePair
    image_sha256: str
    caption: str
    plan: CropPlan
    original_width: int  # of the upright source image, before any upscaling (SDXL's original_size)
    original_height: int
    pixels: torch.Tensor  # (3, bucket height, bucket width) in [-1, 1]
    upscaled: bool = False
    loss_mask: torch.Tensor | None = None  # (1, bucket height / 8, bucket width / 8) in [0, 1] (to_latent_mask)
    mask_sha256: str | None = None  # of its mask file's bytes, when the mask came from one

    def manifest_row(self) -> dict:
        time_ids = micro_conditioning(self.original_width, self.original_height, self.plan)
        return {
            "image_path": self.source.relative_path,
            "image_sha256": self.image_sha256,
            "caption": self.caption,
            "bucket_width": self.plan.bucket.width,
            "bucket_height": self.plan.bucket.height,
            "original_width": time_ids[1],
            "original_height": time_ids[0],
            "crop_top": time_ids[2],
            "crop_left": time_ids[3],
            "crop_left_flipped": self.plan.resized_width - self.plan.bucket.width - self.plan.crop_left,
            "upscaled": self.upscaled,
            "has_loss_mask": self.loss_mask is not None,
            "mask_sha256": self.mask_sha256,
        }


class SkippedItem(Exception):
    """An item that cannot be cached; str() is the reason, for the per-run error log."""

    def __init__(self, source: SourcePair, reason: str, category: str):
        super().__init__(reason)
        self.source = source
        self.category = category  # short key for the end-of-run counts


@dataclass(frozen=True)
class ScanProblem:
    """Something under the data folder that looks like data but cannot be used, with why."""

    relative_path: str
    reason: str
    category: str


@dataclass
class DataScan:
    pairs: list[SourcePair]  # sorted by relative path
    problems: list[ScanProblem]


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


def worker_of(relative_path: str, num_workers: int) -> int:
    """Which of num_workers caches this item: a stable hash of its path, the same on every machine."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % num_workers


def normalized_caption(text: str) -> str:
    """Whitespace collapsed within each line, empty lines dropped: one caption per line (cache.captions_in)."""
    return "\n".join(line for line in (" ".join(raw.split()) for raw in text.splitlines()) if line)


def read_caption(source: SourcePair) -> str:
    """The item's caption: its table text, or its caption file's, normalized (normalized_caption)."""
    if source.caption_text is not None:
        caption = normalized_caption(source.caption_text)
        if not caption:
            raise SkippedItem(source, "its caption in the metadata table is empty: write one", "empty caption")
        return caption
    caption_path = source.expected_caption
    if not caption_path.is_file():
        raise SkippedItem(source, f"no caption file {caption_path.name} next to the image: add one", "missing caption")
    try:
        caption = caption_path.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise SkippedItem(source, f"cannot read the caption file {caption_path.name} ({error.strerror or error}): fix its permissions", "unreadable caption") from error
    except UnicodeDecodeError as error:
        raise SkippedItem(source, f"caption {caption_path.name} is not UTF-8 ({error}): re-save it as UTF-8", "caption not UTF-8") from error
    # One caption per line (several captions of one image: the trainer's caption mode chooses among them).
    caption = normalized_caption(caption)
    if not caption:
        raise SkippedItem(source, f"caption {caption_path.name} is empty: write a caption", "empty caption")
    return caption


def read_source(source: SourcePair) -> tuple[bytes, str, str]:
    """(image bytes, their SHA-256, caption): what decides whether a cached item is still valid."""
    caption = read_caption(source)
    try:
        data = source.tar_member.read_bytes() if source.tar_member else source.image_path.read_bytes()
    except OSError as error:
        raise SkippedItem(source, f"cannot read the file ({error})", "unreadable image") from error
    if not data:
        raise SkippedItem(source, "the file is empty (0 bytes)", "unreadable image")
    return data, sha256_bytes(data), caption


def choose_bucket(
    source: SourcePair, width: int, height: int, min_resolution: int, max_resolution: int, upscale_to_resolution: int
) -> tuple[CropPlan, Bucket | None]:
    """The crop of the image as it is, and the bucket it must be upscaled into first (None: no upscaling)."""
    plan = plan_crop(width, height, min_resolution, max_resolution)
    if plan is None:
        raise SkippedItem(
            source,
            f"{width}x{height} px is too small for the smallest bucket of --min_resolution {min_resolution}",
            "too small",
        )
    return plan, upscale_target(width, height, plan, upscale_to_resolution)


def prepare_item(
    source: SourcePair,
    data: bytes,
    image_sha256: str,
    caption: str,
    min_resolution: int,
    max_resolution: int,
    upscale_to_resolution: int = 0,
    upscale: UpscaleFunction | None = None,
    on_upscaled: Callable[[SourcePair, Image.Image, Image.Image], None] | None = None,
    mask_file: MaskFile | None = None,
    alpha_mask: bool = False,
) -> PreparedItem:
    """Decode, choose the bucket, upscale if the bucket needs it, resize and crop; with a mask file (read_mask_file)
    or alpha_mask the item's loss mask too (mask_image), through the same resize and crop. Raises SkippedItem
    with the reason."""
    try:
        image, alpha = decode_image_and_alpha(data)
    except UnreadableImage as error:
        raise SkippedItem(source, str(error), "unreadable image") from error
    width, height = image.size
    mask = mask_image(source, mask_file, image.size, alpha if alpha_mask else None)
    plan, upscale_bucket = choose_bucket(source, width, height, min_resolution, max_resolution, upscale_to_resolution)
    if upscale_bucket is not None:
        enlarged = upscale(image, max(upscale_bucket.width / width, upscale_bucket.height / height))
        if on_upscaled is not None:
            on_upscaled(source, image, enlarged)
        image = enlarged
        plan = crop_into(image.width, image.height, upscale_bucket, upscale_to_resolution)
        if mask is not None:
            mask = mask.resize(image.size, Image.Resampling.BILINEAR)
    pixels = to_model_input(resize_and_crop(image, plan))
    loss_mask = None if mask is None else to_latent_mask(resize_and_crop(mask, plan))
    return PreparedItem(
        source, image_sha256, caption, plan, width, height, pixels, upscaled=upscale_bucket is not None, loss_mask=loss_mask,
        mask_sha256=mask_file[1] if mask_file is not None else None,
    )


def read_mask_file(source: SourcePair) -> MaskFile | None:
    """The bytes of the item's mask file (source.mask_path) and their SHA-256, which tells a resumed cache run
    that a mask changed; None when the item has none."""
    if source.mask_path is None:
        return None
    try:
        data = source.mask_path.read_bytes()
    except OSError as error:
        raise SkippedItem(
            source, f"cannot read its mask file {source.mask_path.name} ({error.strerror or error}): fix its permissions", "unreadable mask"
        ) from error
    return data, sha256_bytes(data)


def mask_image(source: SourcePair, mask_file: MaskFile | None, image_size: tuple[int, int], alpha: Image.Image | None) -> Image.Image | None:
    """The item's mask at its image's size: its mask file, else `alpha`, else None (the item trains everywhere).
    A mask file of the image's aspect ratio but another size is stretched to it."""
    if mask_file is None:
        return alpha
    name = source.mask_path.name
    try:
        mask = decode_mask(mask_file[0])
    except UnreadableImage as error:
        raise SkippedItem(source, f"its mask file {name} is unreadable ({error}): save it again as a grayscale PNG", "unreadable mask") from error
    if mask.size != image_size:
        (mask_width, mask_height), (width, height) = mask.size, image_size
        if abs(mask_width * height / (mask_height * width) - 1) > MASK_ASPECT_TOLERANCE:
            raise SkippedItem(
                source, f"its mask file {name} is {mask_width}x{mask_height} px, the image {width}x{height} px: draw the mask at the image's size", "mask size"
            )
        mask = mask.resize(image_size, Image.Resampling.BILINEAR)
    return mask
