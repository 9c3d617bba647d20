"""Reading source images: upright, RGB, transparency on white; and resizing + cropping them into a bucket."""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from sdxl_trainer.cache.buckets import LATENT_DOWNSCALE, CropPlan

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
# Pillow refuses images above twice this many pixels; we refuse above it (and never warn about it).
MAX_IMAGE_PIXELS = 16384 * 16384
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS


class UnreadableImage(ValueError):
    """The bytes could not be decoded as a supported image; the message says why."""


# EXIF orientations 5-8 store the picture rotated by 90 or 270 degrees: upright, width and height swap.
EXIF_ORIENTATION_TAG = 0x0112
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)


def upright_size(data: bytes) -> tuple[int, int]:
    """(width, height) of the upright image, read from the header alone (no pixel decoding)."""
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        orientation = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except UnidentifiedImageError as error:
        raise UnreadableImage("not an image in a format Pillow can read (wrong extension, or not an image at all)") from error
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise UnreadableImage(f"not a readable image ({type(error).__name__}: {error})") from error
    if width * height > MAX_IMAGE_PIXELS:
        raise UnreadableImage(f"{width}x{height} px is above the {MAX_IMAGE_PIXELS} px limit")
    return (height, width) if orientation in TRANSPOSED_ORIENTATIONS else (width, height)


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes into an upright RGB image with any transparency composited on white.

    EXIF orientation is applied (phone photos are often stored sideways). Palette and grayscale images
    with transparency keep it; 16-bit and CMYK images are converted. Animated images use the first frame.
    """
    return decode_image_and_alpha(data)[0]


def decode_image_and_alpha(data: bytes) -> tuple[Image.Image, Image.Image | None]:
    """decode_image's RGB image, and its upright alpha channel ("L": 0 transparent, 255 opaque; None when the
    image has no transparency), which --alpha_mask caches as the item's loss mask."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UnreadableImage(f"{width}x{height} px is above the {MAX_IMAGE_PIXELS} px limit")
            image.load()
    except UnreadableImage:
        raise
    except UnidentifiedImageError as error:
        raise UnreadableImage("not an image in a format Pillow can read (wrong extension, or not an image at all)") from error
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise UnreadableImage(f"not a readable image ({type(error).__name__}: {error})") from error

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale: Pillow's "L" conversion clips instead of scaling, so scale the full 16-bit
        # range to 8 bits explicitly (the range is a property of the format, not of this image's pixels).
        array = np.asarray(image, dtype=np.float32)
        image = Image.fromarray(np.clip(array / 65535.0 * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode in ("P", "L", "RGB") and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB"), rgba.getchannel("A")
    return image.convert("RGB"), None


def decode_mask(data: bytes) -> Image.Image:
    """A mask file's bytes -> its upright grayscale image ("L": white 255 = trained, black 0 = not trained);
    a colour mask counts by its luminance."""
    image, _ = decode_image_and_alpha(data)
    return image.convert("L")


def resize_and_crop(image: Image.Image, plan: CropPlan) -> Image.Image:
    """Resize `image` to cover the bucket (Lanczos, downscale only) and cut out the centred crop. A mask
    ("L") goes through the same resize and crop as its image."""
    resized = image.resize((plan.resized_width, plan.resized_height), Image.Resampling.LANCZOS)
    box = (
        plan.crop_left,
        plan.crop_top,
        plan.crop_left + plan.bucket.width,
        plan.crop_top + plan.bucket.height,
    )
    return resized.crop(box)


def to_model_input(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float tensor (3, H, W) in [-1, 1], the VAE's input range."""
    array = np.array(image, dtype=np.uint8)  # a writable copy: torch shares its memory
    return torch.from_numpy(array).permute(2, 0, 1).float().div(127.5).sub(1.0)


def to_latent_mask(mask: Image.Image) -> torch.Tensor:
    """A bucket-sized mask ("L") -> (1, H / 8, W / 8) float in [0, 1]: the mean of each 8 x 8 block, the latent
    pixel it becomes (kohya's area interpolation of the mask to the loss's size)."""
    pixels = torch.from_numpy(np.array(mask, dtype=np.float32) / 255.0)
    return torch.nn.functional.avg_pool2d(pixels[None, None], LATENT_DOWNSCALE)[0]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """Float tensor (N, 3, H, W) in [-1, 1] -> list of RGB PIL images."""
    array = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(frame) for frame in array]
