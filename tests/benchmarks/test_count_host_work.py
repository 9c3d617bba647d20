"""count_host_work.py's arithmetic of the 8-bit step's chunks, against the step's own layout, and of Adafactor's and CAME's runs;
its count by operator."""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from benchmarks.count_host_work import factored_runs, optimizer_chunks
from sdxl_trainer.models.sdxl import NARROW_SDXL_UNET_CONFIG, SDXL_UNET_CONFIG
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


def test_the_narrow_unet_makes_one_factored_run_per_shape_and_the_full_size_one_more():
    """Adafactor's and CAME's host work is per run of same-shaped tensors: at the narrow width every shape's
    tensors fit one run (the counted figure), at full size the largest groups take several."""
    with torch.device("meta"):
        shapes = {tuple(param.shape) for param in UNet2DConditionModel(**SDXL_UNET_CONFIG).parameters()}
    assert len(shapes) == 44
    assert factored_runs(NARROW_SDXL_UNET_CONFIG, ranks=1) == 44
    assert [factored_runs(SDXL_UNET_CONFIG, ranks) for ranks in (1, 2, 8)] == [204, 118, 58]


def test_operators_are_counted_by_name_without_views_or_what_compiled_code_fuses():
    """The count's breakdown by operator (count_host_work.py prints the most dispatched): each operator
    dispatched outside compiled code by its name; views launch nothing, and a compiled function's fused
    kernel is not an operator the host dispatches."""
    from sdxl_trainer.estimates.host_work import HostWork

    fused = torch.compile(lambda values: (values * 2 + 1).sum(), fullgraph=True)
    values = torch.ones(4, 4)
    fused(values)  # compiled before the count
    with HostWork(by_part=False) as counts:
        product = values.mm(values).view(-1)
        torch.add(product, 1)
        product.add_(1)
        fused(values)
    assert counts.operators == {"mm": 1, "add": 1, "add_": 1}
    assert counts.total_ops == 3
