"""Preparing each pair into a bucket-sized image: its caption, upright pixels, bucket and crop, optional
upscaling, and its loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from PIL import Image

from sdxl_trainer.cache.buckets import Bucket, CropPlan, crop_into, micro_conditioning, plan_crop, upscale_target
from sdxl_trainer.cache.format import sha256_bytes
from sdxl_trainer.preparation.images import (
    UnreadableImage,
    decode_image_and_alpha,
    decode_mask,
    resize_and_crop,
    to_latent_mask,
    to_model_input,
)
from sdxl_trainer.preparation.scan import SourcePair, normalized_caption

# A mask whose aspect ratio is within this share of its image's is stretched to the image's size.
MASK_ASPECT_TOLERANCE = 0.01


MaskFile = tuple[bytes, str]  # a mask file's bytes and their SHA-256 (read_mask_file)


# (image, factor) -> the image enlarged by at least factor, e.g. sdxl_trainer.preparation.upscale.Upscaler
UpscaleFunction = Callable[[Image.Image, float], Image.Image]


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
