"""Which training timesteps are drawn how often.

Uniform in [min_timestep, max_timestep) by default. --timestep_sampling logit_normal and
--timestep_bias_strategy instead give each of the 1000 timesteps a weight (timestep_weights) and a
sample's timestep is the inverse CDF of one uniform draw, which is torch.multinomial's distribution
(diffusers' SDXL example and SimpleTuner draw biased timesteps with it) from a generator of our own.
"""

from __future__ import annotations

import numpy as np
import torch

from sdxl_trainer.training.noise_settings import TRAIN_TIMESTEPS, NoiseSettings


def biased_timesteps(settings: NoiseSettings) -> range:
    """The timesteps whose weight --timestep_bias_multiplier multiplies, as diffusers' generate_timestep_weights
    picks them: the first or last int(portion * 1000) of the schedule, or [begin, end) (its code's slice;
    its help calls the end inclusive); none without a strategy."""
    count = int(settings.timestep_bias_portion * TRAIN_TIMESTEPS)
    return {
        "earlier": range(0, count),
        "later": range(TRAIN_TIMESTEPS - count, TRAIN_TIMESTEPS),
        "range": range(settings.timestep_bias_begin, settings.timestep_bias_end),
    }.get(settings.timestep_bias_strategy, range(0))


def timestep_weights(settings: NoiseSettings) -> np.ndarray:
    """The probability of drawing each of the 1000 timesteps (float64, sums to 1).

    uniform: equal on [min_timestep, max_timestep). logit_normal: the distribution of
    min + floor(sigmoid(x) * (max - min)), x ~ N(logit_mean, logit_std), i.e. OneTrainer's discrete
    LOGIT_NORMAL (ModelSetupNoiseMixin._get_timestep_discrete, which maps sigmoid(x) onto the timestep range
    the same way), computed exactly from the normal CDF at the logits of the bin edges. The bias then
    multiplies the weights of biased_timesteps (which may reach outside the range: those stay 0)."""
    low, high = settings.min_timestep, settings.max_timestep
    weights = torch.zeros(TRAIN_TIMESTEPS, dtype=torch.float64)
    if settings.timestep_sampling == "logit_normal":
        edges = torch.logit(torch.linspace(0, 1, high - low + 1, dtype=torch.float64))  # -inf ... +inf
        weights[low:high] = torch.special.ndtr((edges - settings.logit_mean) / settings.logit_std).diff()
    else:
        weights[low:high] = 1.0
    biased = biased_timesteps(settings)
    weights[biased.start : biased.stop] *= settings.timestep_bias_multiplier
    return (weights / weights.sum()).numpy()


def timestep_cdf(settings: NoiseSettings) -> np.ndarray | None:
    """What draw_timestep inverts; None where timesteps are plain uniform (drawn as integers, as ever)."""
    if settings.timestep_sampling == "uniform" and settings.timestep_bias_strategy == "none":
        return None
    cdf = np.cumsum(timestep_weights(settings))
    return cdf / cdf[-1]  # exactly 1 at the end, so every u in [0, 1) finds a timestep


def draw_timestep(generator: np.random.Generator, settings: NoiseSettings, cdf: np.ndarray | None) -> np.ndarray:
    """One timestep, shape (1,) int64. The smallest t with cdf[t] > u: a timestep of weight 0 is never drawn."""
    if cdf is None:
        return generator.integers(settings.min_timestep, settings.max_timestep, (1,), dtype=np.int64)
    return np.searchsorted(cdf, generator.random(1), side="right").astype(np.int64)
