"""Sample grids: the same prompts and seeds rendered at every sample epoch, one row per epoch, in one PNG.

The first row is the base model ("base"), each later call appends a row below ("epoch 3"), so a column shows
one prompt through training. Above the rows a header shows the prompts (wrapped, cut to a few lines) and,
below each, the options its line set (size, seed, guidance...); left of each row its label. Images of any
shape share one layout: each is scaled to fit a square cell and centred on the background (letterboxed), so
a portrait and a landscape column line up and every row has the same height. The file is PNG (lossless):
appending re-opens it and copies the old rows unchanged. The prompts, their options and the row labels are
also kept in the PNG's text metadata, and appending with other prompts or options is refused (the columns
would no longer match their header).

The prompts and their options come from sample_prompts.py.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, PngImagePlugin

CELL_SIZE = 384  # px: each sample is scaled to fit a square cell of this side
LABEL_WIDTH = 120  # px
HEADER_LINES = 4  # of prompt text; one more line holds the column's options
FONT_SIZE = 14
PADDING = 6
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
OPTIONS_TEXT = (0, 70, 160)  # the line under a prompt with its options
METADATA_KEY = "sdxl_trainer_sample_grid"


def is_due(epochs_done: int, every_n_epochs: int, start_epoch: int = 0, num_epochs: int | None = None) -> bool:
    """Whether samples (or a validation) are due after `epochs_done` epochs: epoch 0 (the base model) always,
    then every `every_n_epochs` from `start_epoch` on, and after the last epoch. every_n_epochs 0 = only epoch 0."""
    if epochs_done == 0:
        return True
    if every_n_epochs <= 0 or epochs_done < start_epoch:
        return False
    return epochs_done % every_n_epochs == 0 or epochs_done == num_epochs


def _font(size: int = FONT_SIZE) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)  # ships with Pillow: nothing read from the working directory


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    """Lines of `text` that fit `width` px; the last kept line ends in an ellipsis when text was cut."""
    average = max(1.0, font.getlength("abcdefghijklmnopqrstuvwxyz") / 26)
    lines = textwrap.wrap(text, width=max(4, int(width / average)))
    while any(font.getlength(line) > width for line in lines):  # proportional fonts: tighten until it fits
        lines = textwrap.wrap(text, width=max(4, max(len(line) for line in lines) - 1))
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: max(0, len(lines[-1]) - 1)] + "…"
    return lines


def _line_height(font) -> int:
    left, top, right, bottom = font.getbbox("Ag")
    return bottom - top + 3


def _to_pil(image: Image.Image | torch.Tensor | np.ndarray) -> Image.Image:
    if isinstance(image, torch.Tensor):  # uint8 (3, H, W)
        image = image.permute(1, 2, 0).cpu().numpy()
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    return image.convert("RGB")


def _fit(image: Image.Image, size: int) -> Image.Image:
    """The image scaled to fit a size x size cell (keeping its aspect ratio), centred on the background."""
    scale = size / max(image.size)
    scaled = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.Resampling.LANCZOS)
    cell = Image.new("RGB", (size, size), BACKGROUND)
    cell.paste(scaled, ((size - scaled.width) // 2, (size - scaled.height) // 2))
    return cell


def header_height() -> int:
    return (HEADER_LINES + 1) * _line_height(_font()) + 2 * PADDING


def _header(prompts: list[str], options: list[str], cell_size: int) -> Image.Image:
    font = _font()
    header = Image.new("RGB", (LABEL_WIDTH + cell_size * len(prompts), header_height()), BACKGROUND)
    draw = ImageDraw.Draw(header)
    for column, (prompt, option_text) in enumerate(zip(prompts, options)):
        lines = [(line, TEXT) for line in _wrap(prompt, font, cell_size - 2 * PADDING, HEADER_LINES)]
        lines += [(line, OPTIONS_TEXT) for line in _wrap(option_text, font, cell_size - 2 * PADDING, 1)]
        for line_number, (line, colour) in enumerate(lines):
            draw.text((LABEL_WIDTH + column * cell_size + PADDING, PADDING + line_number * _line_height(font)), line, fill=colour, font=font)
    return header


def _row(images: list, label: str, cell_size: int) -> Image.Image:
    font = _font()
    row = Image.new("RGB", (LABEL_WIDTH + cell_size * len(images), cell_size), BACKGROUND)
    lines = _wrap(label, font, LABEL_WIDTH - 2 * PADDING, 3)
    top = (cell_size - len(lines) * _line_height(font)) // 2
    draw = ImageDraw.Draw(row)
    for line_number, line in enumerate(lines):
        draw.text((PADDING, top + line_number * _line_height(font)), line, fill=TEXT, font=font)
    for column, image in enumerate(images):
        row.paste(_fit(_to_pil(image), cell_size), (LABEL_WIDTH + column * cell_size, 0))
    return row


def append_grid_row(path: Path, images: list, label: str, prompts: list[str], cell_size: int = CELL_SIZE, options: list[str] | None = None) -> Image.Image:
    """Add a row of `images` (one per prompt: PIL images, uint8 (3, H, W) tensors or (H, W, 3) arrays, any
    size) labelled `label` below the grid at `path`, creating the grid with its prompt header if the file
    does not exist; `options` is a line per prompt for the header ("" or None: none). The file is replaced
    atomically. Returns the header over the new row, what TensorBoard and W&B log at this step: logging the
    whole grid each time made their logs grow with the square of the number of rows (100 sample epochs: 5,050
    rows logged for 100 new ones)."""
    options = options or [""] * len(prompts)
    if not len(images) == len(prompts) == len(options):
        raise ValueError(f"{len(images)} images for {len(prompts)} prompts with {len(options)} option lines")
    row = _row(images, label, cell_size)
    if path.exists():
        with Image.open(path) as existing:
            record = json.loads(existing.text.get(METADATA_KEY, "{}"))
            # A grid from before per-prompt options has no "options": its columns had none.
            if record.get("prompts") != prompts or record.get("options", [""] * len(prompts)) != options or record.get("cell_size") != cell_size:
                raise ValueError(
                    f"{path} was started with other sample prompts, prompt options or cell size: move it away (or delete it) "
                    "to start a new grid, or sample with the prompts in its header"
                )
            grid = Image.new("RGB", (existing.width, existing.height + row.height), BACKGROUND)
            grid.paste(existing.convert("RGB"), (0, 0))
        grid.paste(row, (0, grid.height - row.height))
        labels = [*record["labels"], label]
    else:
        header = _header(prompts, options, cell_size)
        grid = Image.new("RGB", (row.width, header.height + row.height), BACKGROUND)
        grid.paste(header, (0, 0))
        grid.paste(row, (0, header.height))
        labels = [label]
    metadata = PngImagePlugin.PngInfo()
    metadata.add_text(METADATA_KEY, json.dumps({"prompts": prompts, "options": options, "cell_size": cell_size, "labels": labels}))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    grid.save(tmp, format="PNG", pnginfo=metadata)
    os.replace(tmp, path)
    header_and_row = Image.new("RGB", (grid.width, header_height() + row.height), BACKGROUND)
    header_and_row.paste(grid.crop((0, 0, grid.width, header_height())), (0, 0))
    header_and_row.paste(row, (0, header_height()))
    return header_and_row
