"""The denoising objective: per-sample noise, timesteps and caption dropout, and the UNet loss.

Every random draw for a sample comes from a generator seeded by (run seed, epoch, item index), not from
the rank's global RNG. So a sample gets the same noise whichever rank or microbatch it lands in, which
makes runs on 1 and N processes comparable step by step, and resumed runs identical to straight ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler


@dataclass(frozen=True)
class NoiseSettings:
    conditional_dropout_percent: float  # share of samples (0-1) trained with the empty caption


def sample_seed(run_seed: int, epoch: int, item_index: int) -> int:
    """A 63-bit seed unique to (run, epoch, item)."""
    return ((run_seed * 1_000_003 + epoch) * 2_147_483_647 + item_index) % (2**63 - 1)


def draw_sample_randomness(
    latents: torch.Tensor, item_indices: torch.Tensor, run_seed: int, epoch: int, num_train_timesteps: int, dropout: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise like `latents`, timesteps (B,) and a caption-dropout mask (B,), drawn per sample on the CPU."""
    noises, timesteps, drop = [], [], []
    for item_index in item_indices.tolist():
        generator = torch.Generator().manual_seed(sample_seed(run_seed, epoch, item_index))
        noises.append(torch.randn(latents.shape[1:], generator=generator))
        timesteps.append(torch.randint(0, num_train_timesteps, (1,), generator=generator))
        drop.append(torch.rand(1, generator=generator) < dropout)
    device = latents.device
    return torch.stack(noises).to(device), torch.cat(timesteps).to(device), torch.cat(drop).to(device)


def training_loss(
    unet: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    noise_scheduler: DDPMScheduler,
    empty_prompt: tuple[torch.Tensor, torch.Tensor],
    run_seed: int,
    epoch: int,
    settings: NoiseSettings,
) -> torch.Tensor:
    """Mean epsilon-prediction MSE of one microbatch (fp32)."""
    latents = batch["latents"].float()
    noise, timesteps, drop = draw_sample_randomness(
        latents, batch["item_index"], run_seed, epoch, noise_scheduler.config.num_train_timesteps, settings.conditional_dropout_percent
    )
    # Classifier-free guidance training: some samples see the empty caption instead of theirs.
    empty_embeds, empty_pooled = empty_prompt
    prompt_embeds = torch.where(drop[:, None, None], empty_embeds.to(latents.device), batch["prompt_embeds"]).float()
    pooled = torch.where(drop[:, None], empty_pooled.to(latents.device), batch["pooled_prompt_embeds"]).float()
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(
        noisy_latents,
        timesteps,
        encoder_hidden_states=prompt_embeds,
        added_cond_kwargs={"text_embeds": pooled, "time_ids": batch["time_ids"].float()},
    ).sample
    return F.mse_loss(prediction.float(), noise, reduction="mean")
