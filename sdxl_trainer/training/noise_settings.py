"""What the objective's functions take (NoiseSettings, named as ObjectiveOptions' fields), and its choices' types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PredictionType = Literal["epsilon", "v_prediction"]
TimestepSampling = Literal["uniform", "logit_normal"]
TimestepBias = Literal["none", "earlier", "later", "range"]
LossType = Literal["l2", "l1", "huber", "smooth_l1"]
HuberSchedule = Literal["constant", "exponential", "snr"]
TRAIN_TIMESTEPS = 1000  # SDXL's training schedule (num_train_timesteps)


@dataclass(frozen=True)
class NoiseSettings:
    conditional_dropout_percent: float  # share of samples (0-1) trained with the empty caption
    noise_offset: float = 0.0  # std of a per-channel constant added to the noise (0 = off)
    noise_offset_random_strength: bool = False  # each sample's offset std drawn from U(0, noise_offset)
    ip_noise_gamma: float = 0.0  # input perturbation: the UNet's input gets noise + gamma * more noise (0 = off)
    ip_noise_gamma_random_strength: bool = False  # each sample's gamma drawn from U(0, ip_noise_gamma)
    min_snr_gamma: float = 0.0  # Min-SNR loss weighting (Hang et al. 2023); 0 = off
    min_timestep: int = 0  # timesteps are drawn from [min_timestep, max_timestep)
    max_timestep: int = 1000
    timestep_sampling: TimestepSampling = "uniform"  # logit_normal: sigmoid(N(logit_mean, logit_std)) mapped onto the range
    logit_mean: float = 0.0
    logit_std: float = 1.0
    timestep_bias_strategy: TimestepBias = "none"  # which timesteps' weights are multiplied (biased_timesteps)
    timestep_bias_multiplier: float = 1.0  # 0 = never drawn
    timestep_bias_begin: int = 0  # range: [begin, end)
    timestep_bias_end: int = 1000
    timestep_bias_portion: float = 0.25  # earlier / later: the first / last int(portion * 1000) timesteps
    loss_type: LossType = "l2"
    huber_schedule: HuberSchedule = "snr"  # how huber / smooth_l1's threshold follows the timestep
    huber_c: float = 0.1
    debiased_estimation_loss: bool = False  # weight each sample's loss by 1/sqrt(SNR) (epsilon) or 1/(SNR+1) (v)
    masked_loss_normalize_area: bool = False  # a masked sample's loss is its mean over the mask, not over the latent
