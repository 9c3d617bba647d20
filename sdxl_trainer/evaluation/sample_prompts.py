"""The sample-prompt file (--sample_prompts): one prompt per line, with per-line options in kohya's syntax.

    a red fox in snow at sunrise --w 832 --h 1216 --d 1234 --l 6.5 --s 28 --n blurry, low quality

Options follow the prompt, each `--name value`, a value running to the next ` --`:
  --w / --h  width / height in px (default --max_resolution): rounded to the nearest multiple of 64 (the
             bucket grid the model was trained on, and a size every SDXL UNet level divides), at least 64
  --d        seed of the starting noise (default: one drawn from --set_seed and the prompt's position)
  --l        classifier-free guidance scale (default --guidance_scale; 1 or less turns guidance off)
  --s        denoising steps, 1-1000 (default --num_inference_steps)
  --n        negative prompt (default: the empty caption, which caption dropout trained)
Names are case-insensitive, as in kohya. An unknown option, a missing or bad value, or an option given
twice is an error naming the file and line (kohya skips what it cannot read; a typo would then quietly
sample something else every epoch). Blank lines and lines starting with # are skipped.

Each line is one column of the sample grid, in file order, topped up with dataset captions to
--num_sample_images; a column keeps its prompt, size, seed and settings at every sample epoch.
"""

from __future__ import annotations

import math
import random
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sdxl_trainer.training.sample_draws import sample_seed

DEFAULT_SAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "sample_prompts.txt"  # at the repository root
SAMPLE_KEY = 1_000_003  # stands in for the epoch in sample_seed(seed, key, prompt position)
SIZE_MULTIPLE = 64  # px
MAX_STEPS = 1000  # the noise schedule's training timesteps: no sampler takes more steps
OPTION_HELP = "--w width, --h height, --d seed, --l guidance scale, --s steps, --n negative prompt"


@dataclass(frozen=True)
class SamplePrompt:
    """One sample-grid column: the prompt and the options its line set (None: the run's default)."""

    text: str
    width: int | None = None  # px, a multiple of 64; None: --max_resolution
    height: int | None = None
    seed: int | None = None  # None: drawn from the run's seed and the column's position
    guidance_scale: float | None = None  # None: --guidance_scale
    steps: int | None = None  # None: --num_inference_steps
    negative: str | None = None  # None: the empty caption

    def options_text(self) -> str:
        """The options the line set, for the grid's header ("" when none): "832x1216, seed 1234, ..."."""
        parts = []
        if self.width is not None and self.height is not None:
            parts.append(f"{self.width}x{self.height}")
        elif self.width is not None or self.height is not None:
            parts.append(f"width {self.width}" if self.width is not None else f"height {self.height}")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        if self.guidance_scale is not None:
            parts.append(f"cfg {self.guidance_scale:g}")
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.negative is not None:
            parts.append(f"neg: {self.negative}")
        return ", ".join(parts)


def _whole_number(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError("is not a whole number") from None


def _size(value: str) -> int:
    """A side in px, rounded to the nearest multiple of 64 (at least 64)."""
    pixels = _whole_number(value)
    if pixels <= 0:
        raise ValueError("must be a positive number of pixels")
    return max(SIZE_MULTIPLE, round(pixels / SIZE_MULTIPLE) * SIZE_MULTIPLE)


def _seed(value: str) -> int:
    seed = _whole_number(value)
    if not 0 <= seed < 2**64:
        raise ValueError("must be from 0 to 2**64 - 1")
    return seed


def _guidance(value: str) -> float:
    try:
        scale = float(value)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(scale) or scale < 0:
        raise ValueError("must be a number >= 0")
    return scale


def _steps(value: str) -> int:
    steps = _whole_number(value)
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"must be from 1 to {MAX_STEPS}")
    return steps


# option name -> (SamplePrompt field, parser of its value)
OPTIONS = {"w": ("width", _size), "h": ("height", _size), "d": ("seed", _seed), "l": ("guidance_scale", _guidance), "s": ("steps", _steps), "n": ("negative", str)}


def parse_prompt_line(line: str, where: str) -> tuple[SamplePrompt, list[str]]:
    """One line of the prompt file -> its prompt and notes about values that were adjusted (sizes rounded).
    `where` ("file:line") starts every message; a bad option raises ValueError."""
    text, *options = re.split(r"(?:^|\s+)--(?=\S)", line.strip())
    text = text.strip()
    if not text:
        raise ValueError(f"{where}: no prompt before the options")
    values: dict[str, object] = {}
    notes = []
    for option in options:
        name, _, value = option.partition(" ")
        name, value = name.lower(), value.strip()
        if name not in OPTIONS:
            raise ValueError(f"{where}: unknown option --{name} (known: {OPTION_HELP})")
        field, parse = OPTIONS[name]
        if field in values:
            raise ValueError(f"{where}: --{name} is given twice")
        if not value:
            raise ValueError(f"{where}: --{name} needs a value")
        try:
            values[field] = parse(value)
        except ValueError as reason:
            raise ValueError(f"{where}: --{name} {value!r} {reason}") from None
        if parse is _size and values[field] != int(value):
            notes.append(f"{where}: --{name} {value} rounded to {values[field]} px (sample sizes are multiples of {SIZE_MULTIPLE})")
    return SamplePrompt(text, **values), notes


def read_prompts(path: Path) -> tuple[list[SamplePrompt], list[str]]:
    """The file's prompts in order, and notes about adjusted values (to show once). Every bad line is
    reported at once, in one ValueError."""
    prompts, notes, problems = [], [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            prompt, line_notes = parse_prompt_line(line, f"{path}:{number}")
        except ValueError as error:
            problems.append(str(error))
            continue
        prompts.append(prompt)
        notes += line_notes
    if problems:
        raise ValueError("bad sample prompt file:\n  " + "\n  ".join(problems))
    return prompts, notes


def choose_sample_prompts(file_prompts: list[SamplePrompt], captions: Sequence[str], count: int, seed: int) -> list[SamplePrompt]:
    """The file's prompts (at most `count`, a line repeated with all its options once), topped up to `count`
    with distinct dataset captions in a seeded order."""
    prompts = list(dict.fromkeys(file_prompts))[:count]
    texts = {prompt.text for prompt in prompts}
    order = array("q", range(len(captions)))  # 8 bytes an item, not a list of ints: the same shuffle
    random.Random(seed).shuffle(order)
    for index in order:
        if len(prompts) >= count:
            break
        if captions[index] not in texts:
            prompts.append(SamplePrompt(captions[index]))
            texts.add(captions[index])
    return prompts


def column_seeds(prompts: list[SamplePrompt], seed: int) -> list[int]:
    """Each column's seed, the same at every sample epoch: its line's --d, else one drawn from the run's
    seed and the column's position."""
    return [prompt.seed if prompt.seed is not None else sample_seed(seed, SAMPLE_KEY, position) for position, prompt in enumerate(prompts)]
