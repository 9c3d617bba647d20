"""Sample grid: one row per call, old rows untouched (lossless PNG), prompt header and row labels, prompts
from the shipped file topped up with captions, the sampling schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdxl_trainer.sample_grid import (
    CELL_SIZE,
    DEFAULT_SAMPLE_PROMPTS,
    LABEL_WIDTH,
    append_grid_row,
    choose_sample_prompts,
    header_height,
    is_due,
    read_prompts,
    sample_seeds,
)

PROMPTS = ["a red circle on a very long caption that has to be wrapped over several lines and then cut short " * 3, "a blue square", "stripes"]


def row_images(seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 96, 64), (3, 64, 64), (3, 48, 112)]  # portrait, square, landscape
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for shape in shapes]


def read(path) -> np.ndarray:
    with Image.open(path) as saved:
        return np.array(saved.convert("RGB"))


def test_grid_grows_by_one_row_per_call_and_keeps_old_rows(tmp_path):
    path = tmp_path / "samples" / "grid.png"
    append_grid_row(path, row_images(0), "base", PROMPTS)
    first = read(path)
    assert first.shape == (header_height() + CELL_SIZE, LABEL_WIDTH + 3 * CELL_SIZE, 3)
    header = first[: header_height(), LABEL_WIDTH:]
    assert (header < 128).any(), "the prompts are written in the header"
    assert (first[header_height() :, :LABEL_WIDTH] < 128).any(), "the row has its label"
    previous = first
    for epoch in (2, 4):
        append_grid_row(path, row_images(epoch), f"epoch {epoch}", PROMPTS)
        grid = read(path)
        assert grid.shape[0] == previous.shape[0] + CELL_SIZE and grid.shape[1] == previous.shape[1]
        assert np.array_equal(grid[: previous.shape[0]], previous), "old rows changed"
        assert not np.array_equal(grid[-CELL_SIZE:, LABEL_WIDTH:], previous[-CELL_SIZE:, LABEL_WIDTH:])
        previous = grid
    with Image.open(path) as saved:
        assert '"labels": ["base", "epoch 2", "epoch 4"]' in saved.text["sdxl_trainer_sample_grid"]


def test_grid_goes_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sdxl_trainer.monitor import MetricsWriter

    grid = append_grid_row(tmp_path / "grid.png", row_images(0), "base", PROMPTS)
    writer = MetricsWriter(tmp_path / "tb", enabled=True)
    writer.image("samples/grid", grid, 0)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    (logged,) = events.Images("samples/grid")
    assert (logged.width, logged.height) == grid.size


def test_grid_refuses_other_prompts(tmp_path):
    path = tmp_path / "grid.png"
    append_grid_row(path, row_images(0), "base", PROMPTS)
    with pytest.raises(ValueError, match="other sample prompts"):
        append_grid_row(path, row_images(1), "epoch 1", ["x", "y", "z"])


def test_prompts_come_from_the_shipped_file_topped_up_with_captions():
    assert DEFAULT_SAMPLE_PROMPTS.name == "sample_prompts.txt" and DEFAULT_SAMPLE_PROMPTS.parent.joinpath("sdxl_FSDP_train.py").exists()
    from_file = read_prompts(DEFAULT_SAMPLE_PROMPTS)
    assert len(from_file) == 4 and not any(prompt.startswith("#") for prompt in from_file)
    captions = [f"caption {i}" for i in range(10)] + [from_file[0]]
    prompts = choose_sample_prompts(from_file, captions, 7, seed=3)
    assert prompts[:4] == from_file and len(prompts) == len(set(prompts)) == 7
    assert prompts == choose_sample_prompts(from_file, captions, 7, seed=3)
    assert choose_sample_prompts(from_file, captions, 2, seed=3) == from_file[:2]
    assert sample_seeds(5, 3) == sample_seeds(5, 3) and len(set(sample_seeds(5, 3))) == 3


def test_schedule():
    due = [epoch for epoch in range(0, 11) if is_due(epoch, every_n_epochs=3, start_epoch=4, num_epochs=10)]
    assert due == [0, 6, 9, 10]
    assert [epoch for epoch in range(0, 5) if is_due(epoch, every_n_epochs=0)] == [0]
    assert [epoch for epoch in range(0, 5) if is_due(epoch, every_n_epochs=1)] == [0, 1, 2, 3, 4]
