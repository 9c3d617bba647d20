"""Random captioned images, as a data folder holds them (image_NNNN.jpg beside image_NNNN.txt)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

WORDS = ("red", "blue", "green", "a cat", "a house", "mountains", "a portrait", "at night", "in the rain", "watercolor")


def write_captioned_images(folder: Path, count: int, side: int, seed: int = 0) -> None:
    """`count` smooth random images of `side` px (low-frequency noise, so that JPEG and the VAE see image-like
    content) with captions of three random words."""
    generator = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        coarse = generator.random((8, 8, 3)) * 255
        image = Image.fromarray(coarse.astype(np.uint8)).resize((side, side), Image.BICUBIC)
        image.save(folder / f"image_{index:04d}.jpg", quality=90)
        caption = ", ".join(generator.choice(WORDS, size=3, replace=False))
        (folder / f"image_{index:04d}.txt").write_text(caption + "\n")
