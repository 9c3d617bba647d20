"""The denoising objective: per-sample noise, timesteps and caption dropout, the prediction target and the loss.

Every random draw for a sample comes from its own generator seeded by (run seed, epoch, sample index),
not from the rank's global RNG: numpy's PCG64 (128-bit state) seeded through a SeedSequence, which hashes
the three numbers, so no two (run, epoch, sample) share their draws. (torch's CPU generator keeps only 32
bits of a seed: with a linear seed, item i+2 in epoch e+2 repeated item i's noise of epoch e.) The sample
index is the item's for its first copy in an epoch, so a repeated item's copies (--dataset_repeats,
data.py) get draws of their own. So a sample gets the same noise whichever rank or microbatch it lands
in, which makes runs on 1 and N processes comparable step by step, and resumed runs identical to straight
ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from diffusers import DDPMScheduler

PredictionType = Literal["epsilon", "v_prediction"]


@dataclass(frozen=True)
class NoiseSettings:
    conditional_dropout_percent: float  # share of samples (0-1) trained with the empty caption
    noise_offset: float = 0.0  # std of a per-channel constant added to the noise (0 = off)
    min_snr_gamma: float = 0.0  # Min-SNR loss weighting (Hang et al. 2023); 0 = off
    min_timestep: int = 0  # timesteps are drawn uniformly from [min_timestep, max_timestep)
    max_timestep: int = 1000


def build_noise_scheduler(base_model: str, prediction_type: PredictionType, zero_terminal_snr: bool) -> DDPMScheduler:
    """The base model's training noise schedule, optionally rescaled to zero terminal SNR
    (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"), which needs
    v-prediction because epsilon is undefined at SNR 0."""
    return DDPMScheduler.from_pretrained(
        base_model, subfolder="scheduler", prediction_type=prediction_type, rescale_betas_zero_snr=zero_terminal_snr
    )


def sample_generator(run_seed: int, epoch: int, sample_index: int) -> np.random.Generator:
    """The generator of one sample's draws in one epoch (see the module docstring)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([run_seed, epoch, sample_index])))


def sample_seed(run_seed: int, key: int, item_index: int) -> int:
    """A 63-bit torch seed for (run, key, item), hashed like sample_generator's: for the generators of
    validation and sample images (CUDA's Philox uses all 64 bits; torch's CPU generator the low 32)."""
    high, low = np.random.SeedSequence([run_seed, key, item_index]).generate_state(2, np.uint32)
    return ((int(high) << 32) | int(low)) & (2**63 - 1)


@dataclass
class SampleRandomness:
    noise: torch.Tensor  # like the latents
    timesteps: torch.Tensor  # (B,) int64
    drop_caption: torch.Tensor  # (B,) bool


def draw_sample_randomness(latents: torch.Tensor, sample_indices: torch.Tensor, run_seed: int, epoch: int, settings: NoiseSettings) -> SampleRandomness:
    """Noise, timestep and caption dropout of each sample, drawn on the CPU from the sample's own generator."""
    noises, timesteps, drop = [], [], []
    channels = latents.shape[1]
    for sample_index in sample_indices.tolist():
        generator = sample_generator(run_seed, epoch, sample_index)
        noise = torch.from_numpy(generator.standard_normal(tuple(latents.shape[1:]), dtype=np.float32))
        timesteps.append(torch.from_numpy(generator.integers(settings.min_timestep, settings.max_timestep, (1,), dtype=np.int64)))
        drop.append(torch.from_numpy(generator.random(1) < settings.conditional_dropout_percent))
        if settings.noise_offset:
            # A shift of each channel's mean lets the model learn very dark or bright images (Guttenberg 2023).
            noise = noise + settings.noise_offset * torch.from_numpy(generator.standard_normal((channels, 1, 1), dtype=np.float32))
        noises.append(noise)
    device = latents.device
    return SampleRandomness(torch.stack(noises).to(device), torch.cat(timesteps).to(device), torch.cat(drop).to(device))


def signal_to_noise(noise_scheduler: DDPMScheduler, timesteps: torch.Tensor) -> torch.Tensor:
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].double()
    return (alphas_cumprod / (1 - alphas_cumprod)).float()


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: PredictionType) -> torch.Tensor:
    """Per-sample loss weights min(SNR, gamma) / SNR for epsilon, min(SNR, gamma) / (SNR + 1) for v.
    The v form stays finite at SNR 0 (zero terminal SNR)."""
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


def condition_on_captions(
    batch: dict[str, torch.Tensor], drop_caption: torch.Tensor, empty_prompt: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Caption embeddings and pooled embeddings, with the empty caption's in place of dropped samples'
    (classifier-free guidance training)."""
    empty_embeds, empty_pooled = (tensor.to(batch["prompt_embeds"].device) for tensor in empty_prompt)
    prompt_embeds = torch.where(drop_caption[:, None, None], empty_embeds, batch["prompt_embeds"]).float()
    pooled = torch.where(drop_caption[:, None], empty_pooled, batch["pooled_prompt_embeds"]).float()
    return prompt_embeds, pooled


def training_loss(
    unet: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    noise_scheduler: DDPMScheduler,
    empty_prompt: tuple[torch.Tensor, torch.Tensor],
    run_seed: int,
    epoch: int,
    settings: NoiseSettings,
) -> torch.Tensor:
    """Mean (optionally Min-SNR-weighted) MSE of one microbatch against the scheduler's target (fp32)."""
    latents = batch["latents"].float()
    randomness = draw_sample_randomness(latents, batch["sample_index"], run_seed, epoch, settings)
    prompt_embeds, pooled = condition_on_captions(batch, randomness.drop_caption, empty_prompt)
    noisy_latents = noise_scheduler.add_noise(latents, randomness.noise, randomness.timesteps)
    prediction = unet(
        noisy_latents,
        randomness.timesteps,
        encoder_hidden_states=prompt_embeds,
        # Whole pixel counts as int64: FSDP2's mixed precision casts every floating-point forward input to
        # bf16/fp16 (3000 px would arrive as 3008), integers it leaves alone; the UNet's Fourier embedding
        # of the ids (and of the int64 timesteps) then runs in fp32, as in kohya's and diffusers' training.
        added_cond_kwargs={"text_embeds": pooled, "time_ids": batch["time_ids"].round().long()},
    ).sample
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, randomness.noise, randomness.timesteps)
    else:
        target = randomness.noise
    per_sample = (prediction.float() - target).square().mean(dim=(1, 2, 3))
    if settings.min_snr_gamma:
        per_sample = per_sample * min_snr_weights(signal_to_noise(noise_scheduler, randomness.timesteps), settings.min_snr_gamma, prediction_type)
    return per_sample.mean()
