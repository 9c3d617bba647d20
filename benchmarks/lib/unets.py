"""The UNets the benchmarks train, built with the same seeded random weights every time (no download), and
synthetic batches shaped for them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdxl_trainer.jobs.train_config import DTYPE_OF_NAME
from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, SDXL_UNET_CONFIG, build_full_size_unet
from sdxl_trainer.models.tiny import TINY_UNET_CONFIG

# The unit tests' synthetic batches (tests/support/unet_batches.py): a benchmark times the batches the tests check.
sys.path.append(str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from unet_batches import empty_prompt_for, synthetic_batch  # noqa: E402

SEED = 0
UNET_BUILDERS = {"sdxl": build_full_size_unet, "tiny": lambda: UNet2DConditionModel(**TINY_UNET_CONFIG)}
UNET_CONFIGS = {"sdxl": SDXL_UNET_CONFIG, "tiny": TINY_UNET_CONFIG}
MODEL_HELP = "sdxl = the full-size SDXL UNet from its published config (2.57 B parameters, random weights); tiny = the tests' tiny SDXL UNet"


def resolution_multiple(model: str) -> int:
    """The image side a resolution must be a multiple of: the VAE's 8x, then the UNet halves the latents once
    per level but the last."""
    return 8 * 2 ** (len(UNET_CONFIGS[model]["block_out_channels"]) - 1)


def new_unet(model: str, weights_dtype: str, gradient_checkpointing: bool, device: torch.device | str) -> UNet2DConditionModel:
    """The model in training mode, built directly on `device` with the same random weights every time."""
    torch.manual_seed(SEED)
    with torch.device(device):
        unet = UNET_BUILDERS[model]()
    if weights_dtype != "fp32":  # cast, as the trainer loads fp32 weights in --weights_dtype: the same start in every dtype
        unet.to(DTYPE_OF_NAME[weights_dtype])
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return unet.train()


def new_batch(unet: UNet2DConditionModel, resolution: int, batch_size: int, device: torch.device | str, rank: int = 0) -> dict[str, torch.Tensor]:
    """Latents of resolution/8 per side, caption embeddings of 77 tokens, pooled embeddings and 6 time ids,
    their widths from the UNet's config; every key on `device`, item indices too, as the trainer moves them.
    Each rank its own items (as the trainer's ranks read their own share): gradients differ between ranks,
    so their reduction rounds as it does in training."""
    latent_side = resolution // 8
    batch = synthetic_batch(unet, list(range(rank * batch_size, (rank + 1) * batch_size)), SEED, height=latent_side, width=latent_side)
    return {key: value.to(device) for key, value in batch.items()}


def empty_prompt(unet: UNet2DConditionModel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings a dropped caption trains on, shaped for `unet`."""
    return tuple(tensor.to(device) for tensor in empty_prompt_for(unet))


def noise_scheduler() -> DDPMScheduler:
    return DDPMScheduler.from_config(SDXL_SCHEDULER_CONFIG)
