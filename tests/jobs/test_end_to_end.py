"""The quickstart's path end to end, exactly as a user runs it: bash quickstart.sh builds the tiny SDXL,
caches sample_dataset/, trains 2 epochs on 2 processes and exports; the export must load and generate."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT
from diffusers import StableDiffusionXLPipeline
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [pytest.mark.multiprocess, pytest.mark.end_to_end]


def test_quickstart_trains_and_exports_a_loadable_pipeline(tmp_path):
    output_dir = tmp_path / "quickstart"
    env = dict(os.environ, OUTPUT_DIR=str(output_dir), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", "quickstart.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Quickstart finished." in result.stdout
    assert "skipped 2 (too small: 2)" in result.stdout  # the two sample images below 256 px
    # Nothing from the libraries: torch's log lines, Python warnings, their progress bars, a launcher traceback.
    library_lines = re.compile(r"^(\[rank\d+\]:)?[WE]\d{4} \d\d:\d\d|\.py:\d+: \w*Warning:|^(Loading weights|Loading pipeline components|Writing model shards)|^Traceback|deprecated|Unable to import|kept in float32")
    console = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    assert [line for line in console if library_lines.search(line)] == []

    run_dir = output_dir / "run"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["num_train_epochs"] == 2 and config["set_seed"] == 123

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/images_per_s", "perf/peak_memory_gib/rank0", "perf/peak_memory_gib/rank1"} <= tags
    logged = events.Scalars("train/loss")
    last_update = logged[-1].step
    # every 10th update (the default cadence) and the run's last
    assert [event.step for event in logged] == sorted({*range(10, last_update + 1, 10), last_update}) and last_update > 20
    assert all(np.isfinite([event.value for event in logged]))

    pipeline = StableDiffusionXLPipeline.from_pretrained(run_dir / "pipeline", torch_dtype=torch.float32)
    assert pipeline.unet.dtype == torch.float32
    assert pipeline.unet.config.addition_embed_type == "text_time"
    base_unet = StableDiffusionXLPipeline.from_pretrained(output_dir / "tiny_sdxl", torch_dtype=torch.float32).unet
    weight_change = max(
        (trained - base).abs().max().item() for trained, base in zip(pipeline.unet.parameters(), base_unet.parameters())
    )
    assert weight_change > 1e-3  # the export holds the trained UNet, not the base one
    image = pipeline(
        "a red circle on a light blue background",
        num_inference_steps=4,
        height=256,
        width=320,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    pixels = np.asarray(image)
    assert image.size == (320, 256)
    assert pixels.std() > 1.0  # a real picture, not a constant or NaN-black frame
