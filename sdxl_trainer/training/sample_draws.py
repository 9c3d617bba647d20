"""Each sample's random draws for an update: its noise, timestep, caption dropout and input noise (run in the
DataLoader workers).

Every random draw for a sample comes from its own generator seeded by (run seed, epoch, sample index),
not from the rank's global RNG: numpy's PCG64 (128-bit state) seeded through a SeedSequence, which hashes
the three numbers, so no two (run, epoch, sample) share their draws. (torch's CPU generator keeps only 32
bits of a seed: with a linear seed, item i+2 in epoch e+2 repeated item i's noise of epoch e.) The sample
index is the item's for its first copy in an epoch, so a repeated item's copies (--dataset_repeats,
data.py) get draws of their own. So a sample gets the same noise whichever rank or microbatch it lands
in, which makes runs on 1 and N processes comparable step by step, and resumed runs identical to straight
ones. A draw an option adds comes after those of the options before it, and only with the option on, so
a sample's other draws stay what they were without it.

Each sample's noise, the target's, may carry a per-channel offset (--noise_offset, Guttenberg
2023) whose strength can itself be drawn (--noise_offset_random_strength, kohya's flag). Input
perturbation (--ip_noise_gamma; Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in Diffusion
Models") noises the UNet's input with that noise plus gamma times a second draw, while the target keeps
the first: kohya's noise + strength * randn_like, optionally with a drawn strength. kohya draws the two
random strengths once per batch; here each sample draws its own, so they too follow (seed, epoch, sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sdxl_trainer.training.dataset import choose_views
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.timesteps import draw_timestep, timestep_cdf


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
    noise: torch.Tensor  # like the latents: the noise the target is made of
    timesteps: torch.Tensor  # (B,) int64
    drop_caption: torch.Tensor  # (B,) bool
    input_noise: torch.Tensor  # the noise in the UNet's input: `noise`, plus the input perturbation where on


def draw_sample_randomness(latents: torch.Tensor, sample_indices: torch.Tensor, run_seed: int, epoch: int, settings: NoiseSettings) -> SampleRandomness:
    """Noise, timestep, caption dropout and input noise of each sample, drawn on the CPU from the sample's
    own generator, in that order; each option's draws follow only while it is on."""
    noises, timesteps, drop, input_noises = [], [], [], []
    shape, channels = tuple(latents.shape[1:]), latents.shape[1]
    cdf = timestep_cdf(settings)
    for sample_index in sample_indices.tolist():
        generator = sample_generator(run_seed, epoch, sample_index)
        noise = torch.from_numpy(generator.standard_normal(shape, dtype=np.float32))
        timesteps.append(torch.from_numpy(draw_timestep(generator, settings, cdf)))
        drop.append(torch.from_numpy(generator.random(1) < settings.conditional_dropout_percent))
        if settings.noise_offset:
            # A shift of each channel's mean lets the model learn very dark or bright images (Guttenberg 2023).
            offsets = torch.from_numpy(generator.standard_normal((channels, 1, 1), dtype=np.float32))
            noise = noise + drawn_strength(generator, settings.noise_offset, settings.noise_offset_random_strength) * offsets
        noises.append(noise)
        input_noise = noise
        if settings.ip_noise_gamma:
            perturbation = torch.from_numpy(generator.standard_normal(shape, dtype=np.float32))
            input_noise = noise + drawn_strength(generator, settings.ip_noise_gamma, settings.ip_noise_gamma_random_strength) * perturbation
        input_noises.append(input_noise)
    device = latents.device
    return SampleRandomness(
        torch.stack(noises).to(device), torch.cat(timesteps).to(device), torch.cat(drop).to(device), torch.stack(input_noises).to(device)
    )


# The batch keys of the draws SampleDraws adds (the input noise only where it differs from the noise).
NOISE_KEY, TIMESTEPS_KEY, DROP_CAPTION_KEY, INPUT_NOISE_KEY = "noise", "timesteps", "drop_caption", "input_noise"


@dataclass(frozen=True)
class SampleDraws:
    """Everything drawn per sample for an update, added to a batch where it is read: the view (--flip_aug),
    the noise, timestep, caption dropout and input noise. In the DataLoader workers (training/stream.py) they
    cost the training process nothing and reach the GPU in the batch's pinned, non-blocking copy; drawn in the
    update they took the process's CPU and copies from pageable memory, which wait for the GPU. The same
    draws wherever they are made: each sample's own generator (sample_generator)."""

    run_seed: int
    settings: NoiseSettings

    def __call__(self, batch: dict[str, torch.Tensor], epoch: int) -> dict[str, torch.Tensor]:
        batch = choose_views(batch, self.run_seed, epoch)
        randomness = draw_sample_randomness(batch["latents"], batch["sample_index"], self.run_seed, epoch, self.settings)
        drawn = {NOISE_KEY: randomness.noise, TIMESTEPS_KEY: randomness.timesteps, DROP_CAPTION_KEY: randomness.drop_caption}
        if randomness.input_noise is not randomness.noise:
            drawn[INPUT_NOISE_KEY] = randomness.input_noise
        return {**batch, **drawn}


def drawn_randomness(batch: dict[str, torch.Tensor]) -> SampleRandomness:
    """What SampleDraws added to a batch."""
    return SampleRandomness(batch[NOISE_KEY], batch[TIMESTEPS_KEY], batch[DROP_CAPTION_KEY], batch.get(INPUT_NOISE_KEY, batch[NOISE_KEY]))


def drawn_strength(generator: np.random.Generator, strength: float, at_random: bool) -> float:
    """`strength`, or with `at_random` strength * U(0, 1) from the sample's generator (kohya's torch.rand(1) * strength)."""
    return strength * float(generator.random()) if at_random else strength


@dataclass(frozen=True)
class DrawsInTurn:
    """Several draws made on the same batch, each after the one before (SampleDraws, then caption mode's
    CaptionDraws), where the batch is read."""

    draws: tuple[Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]], ...]

    def __call__(self, batch: dict[str, torch.Tensor], epoch: int) -> dict[str, torch.Tensor]:
        for draw in self.draws:
            batch = draw(batch, epoch)
        return batch
