"""The trainer's validation on 2 CPU processes: held-out split, validation loss per timestep range, image
metrics with random networks of the real architectures, the sample grid, and all of it across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, run_processes
from metric_networks import write_metric_weights
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sdxl_trainer.evaluation.sample_grid import BACKGROUND, CELL_SIZE, LABEL_WIDTH, METADATA_KEY, header_height
from sdxl_trainer.training.dataset import CachedDataset
from sdxl_trainer.training.holdout import HOLDOUT_FILE

pytestmark = pytest.mark.multiprocess


def tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def run(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir):
    """1 epoch with validation before and after it, then the same run resumed for a second epoch."""
    output_dir = tmp_path_factory.mktemp("validated")
    weights = write_metric_weights(output_dir / "metric_weights")
    prompts = output_dir / "prompts.txt"  # two shapes, two step counts (rank 1 pads the 3-step call), topped up with a caption
    prompts.write_text("a red square --w 256 --h 384 --d 7 --s 3\na blue circle --w 320 --h 200 --l 1 --n green\n", encoding="utf-8")

    def flags(epochs: int) -> list[str]:
        return [
            "--cached_dataset_dirs", str(sample_cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
            *SAMPLE_RESOLUTION_FLAGS,
            "--output_dir", str(output_dir), "--project_name", "run", "--num_train_epochs", str(epochs),
            "--train_batch_size", "1", "--optimizer", "adamw", "--mixed_precision", "fp32", "--set_seed", "3",
            "--dataloader_num_workers", "0", "--no-save_diffusers", "--no-gradient_checkpointing", "--load_saved_state", "latest",
            "--validation_loss_percent", "0.2", "--validation_image_percent", "0.2",
            "--num_inference_steps", "2", "--num_sample_images", "3", "--sample_prompts", str(prompts),
            "--validation_metrics", "fid", "kid", "is", "lpips",
            "--inception_weights", str(weights.inception), "--lpips_weights", str(weights.lpips),
            "--validation_source_dirs", str(SAMPLE_DATASET), "--handoff_dir", str(output_dir / "handoff"),
        ]

    first = run_processes(2, REPO_ROOT / "sdxl_FSDP_train.py", flags(1))
    split_after_first = (output_dir / "run" / HOLDOUT_FILE).read_text()
    resumed = run_processes(2, REPO_ROOT / "sdxl_FSDP_train.py", flags(2))
    return output_dir / "run", first.stdout + first.stderr, resumed.stdout + resumed.stderr, split_after_first


def test_validation_runs_on_the_base_model_and_after_every_epoch(run):
    run_dir, first_log, resumed_log, _ = run
    assert "Validation (base model" in first_log and "Validation (after epoch 1" in first_log
    assert "Validation (base model" not in resumed_log and "Validation (after epoch 2" in resumed_log
    events = tensorboard(run_dir)
    for tag in ("val/loss", "val/loss_t0-333", "val/loss_t333-667", "val/loss_t667-1000", "val/fid", "val/kid", "val/is", "val/lpips"):
        values = [event.value for event in events.Scalars(tag)]
        assert len(values) == 3 and all(np.isfinite(values)), f"{tag}: {values}"  # base, epochs 1, 2
    steps = [event.step for event in events.Scalars("val/loss")]
    assert steps[0] == 0 and steps == sorted(steps)
    losses = [event.value for event in events.Scalars("val/loss")]
    assert losses[-1] < losses[0]  # the held-out loss falls as the model trains
    assert "val/hpsv2" not in events.Tags()["scalars"]  # not asked for


def test_held_out_items_are_saved_once_and_never_trained_on(run, sample_cache_dir):
    run_dir, _, _, split_after_first = run
    assert (run_dir / HOLDOUT_FILE).read_text() == split_after_first  # reused on resume, not redrawn
    record = json.loads(split_after_first)
    dataset = CachedDataset([sample_cache_dir])
    assert len(record["loss_items"]) == round(0.2 * len(dataset)) and set(record["image_items"]) <= set(record["loss_items"])


def test_sample_grid_grows_by_one_row_per_sample_epoch(run):
    run_dir, first_log, _, _ = run
    with Image.open(run_dir / "samples" / "sample_grid.png") as grid:
        record = json.loads(grid.text[METADATA_KEY])
        pixels = np.asarray(grid.convert("RGB"))
    assert record["labels"] == ["base", "epoch 1", "epoch 2"]
    # The prompt file's lines with their options, in file order, then a dataset caption; the same after the resume.
    assert record["prompts"][:2] == ["a red square", "a blue circle"] and len(record["prompts"]) == 3
    assert record["options"] == ["256x384, seed 7, 3 steps", "320x192, cfg 1, neg: green", ""]
    assert "prompts.txt:2: --h 200 rounded to 192 px" in first_log
    assert pixels.shape[0] == header_height() + 3 * CELL_SIZE
    for row in range(3):  # every cell holds an image of its column's shape, letterboxed: portrait, landscape, square
        cells = [pixels[header_height() + row * CELL_SIZE :][:CELL_SIZE, LABEL_WIDTH + column * CELL_SIZE :][:, :CELL_SIZE] for column in range(3)]
        filled = [(cell != BACKGROUND).any(axis=-1) for cell in cells]
        assert filled[0][:, : CELL_SIZE // 7].sum() == 0 and filled[0][:, CELL_SIZE // 2].mean() > 0.9  # 256x384: bars left and right
        assert filled[1][: CELL_SIZE // 6].sum() == 0 and filled[1][CELL_SIZE // 2].mean() > 0.9  # 320x192: bars above and below
        assert filled[2][:, 0].mean() > 0.9 and filled[2][0].mean() > 0.9  # 512x512 fills its cell
    # TensorBoard gets the header over each step's row, not the whole grid again.
    assert [(image.width, image.height) for image in tensorboard(run_dir).Images("samples/grid")] == [(pixels.shape[1], header_height() + CELL_SIZE)] * 3
    assert not list((run_dir.parent / "handoff").glob("sdxl_handoff_*"))  # handoff folders removed
