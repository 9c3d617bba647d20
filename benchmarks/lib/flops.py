"""FLOP per training image and the device's matmul peak: MFU = images/s x FLOP per image / peak.

FLOP per image: FlopCounterMode over one forward + backward at batch 1, run on the meta device (shapes only: no
compute and no memory, so the count is the same on any machine), with attention through SDPA's math backend
so that its matmuls count on every device. With gradient checkpointing the recomputed forward counts too, so
that MFU is then strictly hardware FLOP utilisation. diffusers recomputes the ResNet and transformer blocks,
not the whole forward, which is why the count with checkpointing is below issue 7's nominal figure (which
assumes a full recompute; docs/design.md §8 gives both)."""

from __future__ import annotations

import functools
import math
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.lib.steps import reference_loss
from benchmarks.lib.timing import synchronize
from benchmarks.lib.unets import new_batch, new_unet, noise_scheduler

# Issue 7's figures for SDXL at 1024 px: TFLOP per training image without / with activation recompute.
NOMINAL_TFLOP_1024 = {False: 20.3, True: 27.0}


@functools.cache
def flop_per_image(model: str, resolution: int, gradient_checkpointing: bool) -> float:
    """FLOP of one training image (forward + backward at batch 1, recompute included), counted on the meta
    device; the weights' dtype does not change it."""
    unet = new_unet(model, "fp32", gradient_checkpointing, "meta")
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        reference_loss(unet, new_batch(unet, resolution, 1, "meta"), noise_scheduler()).backward()
    return float(counter.get_total_flops())


def matmul_side(device: torch.device) -> int:
    return 8192 if device.type == "cuda" else 1024


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of several timed square matmuls of matmul_side(device) in `dtype`."""
    side, repeats = matmul_side(device), (50 if device.type == "cuda" else 3)
    left, right = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    out = left @ right
    best = math.inf
    for _ in range(3 if device.type == "cpu" else 5):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(left, right, out=out)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * side**3 * repeats / best
