"""Multi-resolution aspect-ratio buckets, the crop that fits an image into one, and SDXL micro-conditioning.

Bucket table (version below): for every resolution category R from 256 to 2048 px in steps of 64, the
buckets are the (width, height) pairs with both sides multiples of 64, width x height <= R x R, and an
aspect ratio between 1:2 and 2:1. For each landscape width the largest allowed height is kept (so every
bucket is as close to R x R pixels as 64-px steps allow), and portrait buckets mirror landscape ones.

An image goes to the largest category (up to the maximum resolution) whose nearest-aspect bucket fits
inside it, so images are only ever scaled down: scale to cover the bucket, then centre crop. With
upscaling on, an image whose category is below the upscale resolution R is first enlarged by a network
and then cropped into the nearest-aspect bucket of category R (`upscale_target`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from sdxl_trainer.config import option

BUCKET_TABLE_VERSION = 1
SIDE_MULTIPLE = 64
LATENT_DOWNSCALE = 8  # VAE: latent side = image side / 8
MIN_CATEGORY = 256
MAX_CATEGORY = 2048
MAX_ASPECT = 2.0  # width / height between 1 / MAX_ASPECT and MAX_ASPECT


@dataclass(frozen=True, order=True)
class Bucket:
    width: int
    height: int

    @property
    def aspect(self) -> float:
        return self.width / self.height

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class CropPlan:
    """How one source image becomes a bucket-sized training image. Sizes are (width, height) in px."""

    bucket: Bucket
    category: int  # resolution category R of the bucket
    resized_width: int  # the image is first resized to this (covering the bucket) ...
    resized_height: int
    crop_left: int  # ... then cropped from here, in resized-image pixels
    crop_top: int


def validate_resolution(resolution: int, flag: str) -> None:
    if resolution % SIDE_MULTIPLE or not MIN_CATEGORY <= resolution <= MAX_CATEGORY:
        raise ValueError(
            f"{flag}={resolution} is not a bucket category: use a multiple of {SIDE_MULTIPLE} "
            f"from {MIN_CATEGORY} to {MAX_CATEGORY}."
        )


@dataclass(kw_only=True)
class ResolutionOptions:
    """Resolution range"""

    min_resolution: int | None = option(
        None,
        help="smallest bucket category in px (multiple of 64, 256-2048). Caching: smaller images are skipped; None = 512. Training: "
        "None = the caches' (read from them); given, it must equal theirs",
    )
    max_resolution: int | None = option(
        None,
        help="largest bucket category in px (multiple of 64, 256-2048). Caching: larger images are scaled down; None = 1024. Training: "
        "also the sample images' size; None = the caches' (read from them); given, it must equal theirs",
    )

    def problems(self) -> list[str]:
        problems = []
        for name in ("min_resolution", "max_resolution"):
            if getattr(self, name) is None:
                continue
            try:
                validate_resolution(getattr(self, name), f"--{name}")
            except ValueError as error:
                problems.append(str(error))
        return problems


@lru_cache(maxsize=None)
def buckets_for_category(category: int) -> tuple[Bucket, ...]:
    """All buckets of resolution category `category`, sorted by aspect ratio (tall to wide).

    Landscape buckets (width >= height) take, for each width, the largest height the area allows;
    portrait buckets are their transposes, so both orientations get the same choice of shapes."""
    validate_resolution(category, "category")
    area = category * category
    landscape = set()
    for width in range(category, int(category * MAX_ASPECT) + 1, SIDE_MULTIPLE):
        height = (area // width) // SIDE_MULTIPLE * SIDE_MULTIPLE
        if height >= SIDE_MULTIPLE and width / height <= MAX_ASPECT:
            landscape.add(Bucket(width, height))
    buckets = landscape | {Bucket(bucket.height, bucket.width) for bucket in landscape}
    return tuple(sorted(buckets, key=lambda b: (b.aspect, b.width)))


def categories(min_resolution: int, max_resolution: int) -> list[int]:
    """Resolution categories from min to max resolution inclusive."""
    validate_resolution(min_resolution, "--min_resolution")
    validate_resolution(max_resolution, "--max_resolution")
    if min_resolution > max_resolution:
        raise ValueError(f"--min_resolution {min_resolution} is above --max_resolution {max_resolution}.")
    return list(range(min_resolution, max_resolution + 1, SIDE_MULTIPLE))


def nearest_aspect_bucket(width: int, height: int, category: int) -> Bucket:
    """The bucket of `category` whose aspect ratio is closest to width/height (in log space)."""
    log_aspect = math.log(width / height)
    return min(buckets_for_category(category), key=lambda b: (abs(math.log(b.aspect) - log_aspect), b.width))


def plan_crop(width: int, height: int, min_resolution: int, max_resolution: int) -> CropPlan | None:
    """Choose the bucket for a width x height image and the resize + centre crop into it.

    Returns None when the image is too small for the smallest category (it would need upscaling).
    """
    for category in reversed(categories(min_resolution, max_resolution)):
        bucket = nearest_aspect_bucket(width, height, category)
        if bucket.width <= width and bucket.height <= height:
            return crop_into(width, height, bucket, category)
    return None


def upscale_target(width: int, height: int, plan: CropPlan, upscale_to_resolution: int) -> Bucket | None:
    """The bucket of category `upscale_to_resolution` that a width x height image must be upscaled into
    before cropping, or None (upscaling off, or the image already reaches that category)."""
    if not upscale_to_resolution or plan.category >= upscale_to_resolution:
        return None
    return nearest_aspect_bucket(width, height, upscale_to_resolution)


def crop_into(width: int, height: int, bucket: Bucket, category: int) -> CropPlan:
    """Scale width x height so it just covers `bucket`, then centre the crop."""
    scale = max(bucket.width / width, bucket.height / height)
    # Rounding could leave a side one pixel short of the bucket; never let it.
    resized_width = max(bucket.width, round(width * scale))
    resized_height = max(bucket.height, round(height * scale))
    return CropPlan(
        bucket=bucket,
        category=category,
        resized_width=resized_width,
        resized_height=resized_height,
        crop_left=(resized_width - bucket.width) // 2,
        crop_top=(resized_height - bucket.height) // 2,
    )


def micro_conditioning(
    original_width: int, original_height: int, plan: CropPlan
) -> tuple[int, int, int, int, int, int]:
    """SDXL's add_time_ids for one image: original (h, w), crop top-left (top, left), target (h, w).

    The crop offset is in resized-image pixels, as in SDXL training (Podell et al. 2023, section 2.2).
    """
    return (
        original_height,
        original_width,
        plan.crop_top,
        plan.crop_left,
        plan.bucket.height,
        plan.bucket.width,
    )
