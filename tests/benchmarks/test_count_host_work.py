"""count_host_work.py's arithmetic of the 8-bit step's chunks, against the step's own layout."""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from benchmarks.count_host_work import optimizer_chunks
from sdxl_trainer.models.sdxl import NARROW_SDXL_UNET_CONFIG
from sdxl_trainer.optimizers.adamw8bit import AdamW8bit


@pytest.mark.slow  # SDXL's 1,680 tensors at a narrow width, made on the CPU
def test_the_chunks_worked_out_on_the_meta_device_are_the_ones_the_step_makes():
    unet = UNet2DConditionModel(**NARROW_SDXL_UNET_CONFIG)
    params = list(unet.parameters())
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer = AdamW8bit(params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    layout = optimizer._layout((0, None), params)
    made = sum(len(batch.chunks) for batch in layout.batches)
    assert made == optimizer_chunks(NARROW_SDXL_UNET_CONFIG, ranks=1) == 3
