"""Generate `sample_dataset/`: 30 licence-clean image + caption pairs drawn by this script.

The images are simple scenes (coloured shapes on a background) whose captions say exactly what is
drawn, so a model trained on them has something learnable. Their files are chosen to exercise the
caching pipeline: sizes from 160 px to 2304 px, aspect ratios from 1:3 to 3:1, RGBA and palette PNGs
with transparency, grayscale, a JPEG stored sideways with an EXIF rotation tag, and WebP.

Run: python tools/make_sample_dataset.py [OUTPUT_DIR]   (default: sample_dataset/ beside this folder)
The output is deterministic; re-running rewrites the same files.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {
    "red": (210, 40, 40),
    "orange": (240, 140, 30),
    "yellow": (240, 210, 40),
    "green": (50, 160, 70),
    "blue": (40, 80, 200),
    "purple": (130, 60, 170),
    "pink": (240, 130, 180),
    "brown": (120, 80, 40),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
BACKGROUNDS = {
    "light blue": (170, 205, 235),
    "pale yellow": (245, 238, 190),
    "light grey": (205, 205, 205),
    "dark blue": (25, 35, 80),
    "mint green": (190, 235, 205),
    "beige": (225, 210, 180),
}
SHAPES = ("circle", "square", "triangle", "horizontal stripe", "vertical stripe")


@dataclass(frozen=True)
class SampleSpec:
    """One file to write: pixel size, how it is stored, and what makes it a useful test case."""

    width: int
    height: int
    file_format: str  # "png", "jpg", "webp"
    mode: str = "RGB"  # RGB, RGBA (transparent background), P (palette + transparency), L (grayscale)
    exif_rotated: bool = False  # stored rotated 90 degrees with EXIF orientation 6 (display = upright)


SPECS = [
    SampleSpec(1024, 1024, "jpg"),
    SampleSpec(1216, 832, "jpg"),
    SampleSpec(832, 1216, "jpg"),
    SampleSpec(2304, 1536, "jpg"),  # above 2048 px
    SampleSpec(1536, 2304, "jpg"),
    SampleSpec(160, 160, "png"),  # below 256 px: skipped by the default minimum resolution
    SampleSpec(240, 200, "png"),
    SampleSpec(1200, 400, "jpg"),  # 3:1
    SampleSpec(400, 1200, "jpg"),  # 1:3
    SampleSpec(1400, 700, "jpg"),  # 2:1
    SampleSpec(700, 1400, "jpg"),
    SampleSpec(768, 768, "png", mode="RGBA"),
    SampleSpec(640, 896, "png", mode="RGBA"),
    SampleSpec(512, 512, "png", mode="P"),
    SampleSpec(896, 640, "png", mode="P"),
    SampleSpec(512, 768, "png", mode="L"),
    SampleSpec(1024, 640, "jpg", mode="L"),
    SampleSpec(960, 640, "jpg", exif_rotated=True),
    SampleSpec(640, 960, "jpg", exif_rotated=True),
    SampleSpec(1024, 768, "webp"),
    SampleSpec(768, 1024, "webp"),
    SampleSpec(512, 512, "webp", mode="RGBA"),
    SampleSpec(1280, 1280, "jpg"),
    SampleSpec(2048, 2048, "jpg"),
    SampleSpec(384, 384, "jpg"),
    SampleSpec(320, 448, "jpg"),
    SampleSpec(576, 320, "jpg"),
    SampleSpec(1088, 896, "jpg"),
    SampleSpec(896, 1152, "webp"),
    SampleSpec(1344, 768, "jpg"),
]


def draw_scene(spec: SampleSpec, rng: random.Random) -> tuple[Image.Image, str]:
    """Draw 1-3 shapes on a background and return the RGBA image and a caption describing it."""
    transparent = spec.mode in ("RGBA", "P")
    background_name = rng.choice(list(BACKGROUNDS))
    fill = (0, 0, 0, 0) if transparent else BACKGROUNDS[background_name] + (255,)
    image = Image.new("RGBA", (spec.width, spec.height), fill)
    draw = ImageDraw.Draw(image)
    short_side = min(spec.width, spec.height)
    described = []
    for _ in range(rng.randint(1, 3)):
        colour_name = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        colour = COLOURS[colour_name] + (255,)
        size = rng.randint(short_side // 5, short_side // 2)
        x = rng.randint(0, spec.width - size)
        y = rng.randint(0, spec.height - size)
        if shape == "circle":
            draw.ellipse((x, y, x + size, y + size), fill=colour)
        elif shape == "square":
            draw.rectangle((x, y, x + size, y + size), fill=colour)
        elif shape == "triangle":
            draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=colour)
        elif shape == "horizontal stripe":
            draw.rectangle((0, y, spec.width, y + size // 4), fill=colour)
        else:
            draw.rectangle((x, 0, x + size // 4, spec.height), fill=colour)
        article = "an" if colour_name[0] in "aeiou" else "a"
        described.append(f"{article} {colour_name} {shape}")
    shapes_text = described[0] if len(described) == 1 else ", ".join(described[:-1]) + " and " + described[-1]
    if transparent:
        caption = f"{shapes_text} on a transparent background"
    elif spec.mode == "L":
        caption = f"black and white picture of {shapes_text} on a {background_name} background"
    else:
        caption = f"{shapes_text} on a {background_name} background"
    orientation = "square" if spec.width == spec.height else ("wide" if spec.width > spec.height else "tall")
    return image, f"{caption}, simple flat illustration, {orientation} format"


def save_image(image: Image.Image, spec: SampleSpec, path: Path) -> None:
    if spec.mode == "RGBA":
        stored = image
    elif spec.mode == "P":
        # Palette image whose index 0 is fully transparent, as GIF-style PNGs store transparency.
        rgb = Image.new("RGB", image.size, (0, 0, 0))
        rgb.paste(image, mask=image.getchannel("A"))
        stored = rgb.quantize(colors=32)
        alpha = image.getchannel("A").point(lambda a: 255 if a > 127 else 0)
        stored.paste(32, mask=Image.eval(alpha, lambda a: 255 - a))
        stored.info["transparency"] = 32
    elif spec.mode == "L":
        stored = image.convert("RGB").convert("L")
    else:
        stored = image.convert("RGB")

    if spec.exif_rotated:
        # Store the pixels rotated 90 degrees clockwise; orientation 6 tells viewers to rotate them back.
        stored = stored.transpose(Image.Transpose.ROTATE_270)
        exif = Image.Exif()
        exif[0x0112] = 6
        stored.save(path, quality=88, exif=exif)
    elif spec.file_format == "jpg":
        stored.save(path, quality=85)
    elif spec.file_format == "webp":
        stored.save(path, quality=80)
    else:
        stored.save(path, optimize=True)


def main(output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261121)
    for index, spec in enumerate(SPECS):
        image, caption = draw_scene(spec, rng)
        # Nest a few files one folder down so the scan's recursion is exercised.
        folder = output_dir / "nested" if index % 10 == 9 else output_dir
        folder.mkdir(exist_ok=True)
        stem = f"sample_{index:02d}"
        save_image(image, spec, folder / f"{stem}.{spec.file_format}")
        (folder / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    print(f"Wrote {len(SPECS)} image + caption pairs to {output_dir}")


if __name__ == "__main__":
    default_dir = Path(__file__).resolve().parent.parent / "sample_dataset"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir)
