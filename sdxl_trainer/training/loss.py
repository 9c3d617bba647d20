"""The training loss of a microbatch: the UNet's prediction against the noise schedule's target (run in the step).

Each sample's loss is an elementwise loss of prediction minus target (--loss_type: l2 = squared
error, l1, or kohya's pseudo-Huber "huber" and "smooth_l1" with a threshold per timestep, see
huber_thresholds), times the sample's loss mask if it has one (--masked_loss), averaged over the latent,
then weighted per sample: Min-SNR, then debiased estimation; the microbatch's loss is the mean over its samples.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sdxl_trainer.cache.format import LOSS_MASK_KEY
from sdxl_trainer.training.noise_settings import LossType, NoiseSettings, PredictionType
from sdxl_trainer.training.sample_draws import NOISE_KEY, draw_sample_randomness, drawn_randomness

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import DDPMScheduler


def build_noise_scheduler(base_model: str, prediction_type: PredictionType, zero_terminal_snr: bool) -> DDPMScheduler:
    """The base model's training noise schedule, optionally rescaled to zero terminal SNR
    (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"), which needs
    v-prediction because epsilon is undefined at SNR 0."""
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_pretrained(
        base_model, subfolder="scheduler", prediction_type=prediction_type, rescale_betas_zero_snr=zero_terminal_snr
    )


def signal_to_noise(noise_scheduler: DDPMScheduler, timesteps: torch.Tensor) -> torch.Tensor:
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].double()
    return (alphas_cumprod / (1 - alphas_cumprod)).float()


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: PredictionType) -> torch.Tensor:
    """Per-sample loss weights min(SNR, gamma) / SNR for epsilon, min(SNR, gamma) / (SNR + 1) for v.
    The v form stays finite at SNR 0 (zero terminal SNR)."""
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


def debiased_weights(snr: torch.Tensor, prediction_type: PredictionType) -> torch.Tensor:
    """Per-sample loss weights of debiased estimation (Yu et al. 2023, "Debias the Training of Diffusion
    Models") as kohya's apply_debiased_estimation: 1/sqrt(SNR) for epsilon, 1/(SNR + 1) for v, with SNR
    capped at 1000 (timestep 0 of SDXL's schedule has about 1175). Finite at SNR 0 for v."""
    snr = torch.clamp(snr, max=1000)
    return 1 / (snr + 1) if prediction_type == "v_prediction" else snr.rsqrt()


def huber_thresholds(noise_scheduler: DDPMScheduler, timesteps: torch.Tensor, settings: NoiseSettings) -> torch.Tensor:
    """Each sample's pseudo-Huber threshold, as kohya's get_huber_threshold_if_needed (huber_scale 1):
    constant: c; exponential: exp(-a t) with a = -ln(c) / 1000, i.e. c^(t/1000), from 1 at t = 0 down to c;
    snr: (1 - c) / (1 + sigma_t)^2 + c with sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t), near 1 at low
    noise and c at high noise (c exactly at zero terminal SNR)."""
    c = settings.huber_c
    if settings.huber_schedule == "constant":
        return torch.full(timesteps.shape, c, device=timesteps.device)
    if settings.huber_schedule == "exponential":
        return torch.exp(math.log(c) / noise_scheduler.config.num_train_timesteps * timesteps.double()).float()
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].double()
    sigmas = ((1 - alphas_cumprod) / alphas_cumprod).sqrt()
    return ((1 - c) / (1 + sigmas) ** 2 + c).float()


def elementwise_loss(difference: torch.Tensor, loss_type: LossType, thresholds: torch.Tensor | None) -> torch.Tensor:
    """The loss of each element of prediction - target, as kohya's conditional_loss: l2 = d^2, l1 = |d|,
    huber = 2c(sqrt(d^2 + c^2) - c) (about d^2 below c, 2c|d| above), smooth_l1 = 2(sqrt(d^2 + c^2) - c)
    (about d^2 / c below c, 2|d| above), with the sample's threshold c (huber_thresholds)."""
    if loss_type == "l2":
        return difference.square()
    if loss_type == "l1":
        return difference.abs()
    c = thresholds.view(-1, *([1] * (difference.ndim - 1)))
    smooth = 2 * ((difference.square() + c.square()).sqrt() - c)
    return c * smooth if loss_type == "huber" else smooth


def sample_losses(
    prediction: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    noise_scheduler: DDPMScheduler,
    settings: NoiseSettings,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sample's weighted loss (B,), fp32: --loss_type's elementwise loss, times its loss mask (B, 1, h, w)
    if given, averaged over the latent (as kohya's masked loss; with masked_loss_normalize_area divided by the
    mask's mean, so it is the mean over the masked area, as OneTrainer's option), times its Min-SNR weight,
    times its debiased-estimation weight (kohya applies them in this order to the same per-sample means)."""
    thresholds = huber_thresholds(noise_scheduler, timesteps, settings) if settings.loss_type in ("huber", "smooth_l1") else None
    elementwise = elementwise_loss(prediction.float() - target, settings.loss_type, thresholds)
    if loss_mask is None:
        losses = elementwise.mean(dim=(1, 2, 3))
    else:
        mask = loss_mask.float()
        losses = (elementwise * mask).mean(dim=(1, 2, 3))
        if settings.masked_loss_normalize_area:
            # An all-black mask trains nothing (0 / tiny = 0) rather than dividing by zero.
            losses = losses / mask.mean(dim=(1, 2, 3)).clamp(min=1e-6)
    prediction_type = noise_scheduler.config.prediction_type
    if settings.min_snr_gamma:
        losses = losses * min_snr_weights(signal_to_noise(noise_scheduler, timesteps), settings.min_snr_gamma, prediction_type)
    if settings.debiased_estimation_loss:
        losses = losses * debiased_weights(signal_to_noise(noise_scheduler, timesteps), prediction_type)
    return losses


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
    sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean loss of one microbatch against the scheduler's target (fp32; see sample_losses). sample_weights
    (B,): each sample's loss is multiplied by its weight before the mean (--dataset_loss_weights), as kohya's
    per-sample loss weights (prior_loss_weight) and OneTrainer's concept loss_weight do: not renormalised, so
    a weight below 1 lowers that dataset's share of the gradient and the loss's scale alike."""
    latents = batch["latents"].float()
    randomness = drawn_randomness(batch) if NOISE_KEY in batch else draw_sample_randomness(latents, batch["sample_index"], run_seed, epoch, settings)
    prompt_embeds, pooled = condition_on_captions(batch, randomness.drop_caption, empty_prompt)
    noisy_latents = noise_scheduler.add_noise(latents, randomness.input_noise, randomness.timesteps)
    prediction = unet(
        noisy_latents,
        randomness.timesteps,
        encoder_hidden_states=prompt_embeds,
        # Whole pixel counts as int64: FSDP2's mixed precision casts every floating-point forward input to
        # bf16/fp16 (3000 px would arrive as 3008), integers it leaves alone; the UNet's Fourier embedding
        # of the ids (and of the int64 timesteps) then runs in fp32, as in kohya's and diffusers' training.
        added_cond_kwargs={"text_embeds": pooled, "time_ids": batch["time_ids"].round().long()},
    ).sample
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, randomness.noise, randomness.timesteps)
    else:
        target = randomness.noise
    losses = sample_losses(prediction, target, randomness.timesteps, noise_scheduler, settings, batch.get(LOSS_MASK_KEY))
    if sample_weights is not None:
        losses = losses * sample_weights.to(losses.device, torch.float32)
    return losses.mean()
