"""The objective's options (noise, timesteps, target and loss) and the checks of their values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sdxl_trainer.config import option
from sdxl_trainer.training.noise_settings import HuberSchedule, LossType, NoiseSettings, TimestepBias, TimestepSampling
from sdxl_trainer.training.timesteps import biased_timesteps, timestep_weights


@dataclass(kw_only=True)
class ObjectiveOptions:
    """Objective: noise, timesteps, target and loss"""

    conditional_dropout_percent: float = option(0.1, help="share (0-1) of samples trained with the empty caption, for classifier-free guidance")
    prediction_type: Literal["epsilon", "v_prediction"] = option("epsilon", help="training target; SDXL base predicts epsilon")
    zero_terminal_snr: bool = option(
        False, help="rescale the noise schedule to zero SNR at the last timestep (needs --prediction_type v_prediction)"
    )
    min_snr_gamma: float = option(0.0, help="Min-SNR loss weighting gamma (5 is the paper's value); 0 = off")
    noise_offset: float = option(0.0, help="std of a per-channel offset added to the noise (0.03-0.1 helps very dark/bright images); 0 = off")
    noise_offset_random_strength: bool = option(
        False, help="draw each sample's offset std uniformly from [0, --noise_offset) (kohya's flag; drawn per sample here, per batch there)"
    )
    ip_noise_gamma: float = option(
        0.0,
        help="input perturbation (Ning et al. 2023; kohya's flag): the UNet's input is noised with noise + gamma * a second noise while "
        "the target keeps the first, against exposure bias; about 0.1 is the usual value; 0 = off",
    )
    ip_noise_gamma_random_strength: bool = option(
        False, help="draw each sample's gamma uniformly from [0, --ip_noise_gamma) (kohya's flag; drawn per sample here, per batch there)"
    )
    min_timestep: int = option(0, help="smallest training timestep drawn (inclusive)")
    max_timestep: int = option(1000, help="training timesteps are drawn below this (exclusive); SDXL has 1000")
    timestep_sampling: TimestepSampling = option(
        "uniform",
        help="distribution of training timesteps over [--min_timestep, --max_timestep): uniform, or logit_normal = "
        "sigmoid(x) of x ~ N(--logit_mean, --logit_std) mapped onto that range (OneTrainer's LOGIT_NORMAL; SD3's sampling), "
        "which favours the middle timesteps",
    )
    logit_mean: float = option(0.0, help="logit_normal: mean of x; > 0 moves the draws towards noisier (later) timesteps")
    logit_std: float = option(1.0, help="logit_normal: std of x (> 0); smaller concentrates the draws around the middle")
    timestep_bias_strategy: TimestepBias = option(
        "none",
        help="draw some timesteps --timestep_bias_multiplier times as often (diffusers' SDXL example, SimpleTuner): earlier = the "
        "first --timestep_bias_portion of the 1000 (low noise: fine detail), later = the last portion (high noise: composition, "
        "colour), range = [--timestep_bias_begin, --timestep_bias_end); none = off. Applies on top of --timestep_sampling",
    )
    timestep_bias_multiplier: float = option(
        1.0, help="weight factor of the biased timesteps: 2 = twice as often, 0.5 = half as often, 0 = never (diffusers refuses 0)"
    )
    timestep_bias_begin: int = option(0, help="range: first biased timestep (inclusive)")
    timestep_bias_end: int = option(1000, help="range: end of the biased timesteps (exclusive, like diffusers' slice)")
    timestep_bias_portion: float = option(0.25, help="earlier / later: share (0-1) of the 1000 timesteps biased: the first or last int(portion * 1000)")
    loss_type: LossType = option(
        "l2",
        help="elementwise loss of prediction - target d (kohya's --loss_type): l2 = d^2; l1 = |d|; huber = 2c(sqrt(d^2 + c^2) - c), "
        "about d^2 below the threshold c and 2c|d| above, so outliers pull less; smooth_l1 = the same without the factor c "
        "(about d^2/c, then 2|d|). Validation loss stays MSE whatever this is",
    )
    huber_schedule: HuberSchedule = option(
        "snr",
        help="huber / smooth_l1: the threshold c at timestep t (kohya's): constant = --huber_c; exponential = huber_c^(t/1000), "
        "1 at t = 0 down to --huber_c; snr = (1 - huber_c) / (1 + sigma_t)^2 + huber_c, sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t): "
        "near 1 (MSE-like) at low noise, --huber_c at high noise",
    )
    huber_c: float = option(0.1, help="huber / smooth_l1: the threshold (constant) or the one reached at high noise (exponential, snr); > 0, at most 1 with a schedule")
    debiased_estimation_loss: bool = option(
        False,
        help="weight each sample's loss by 1/sqrt(SNR) (epsilon) or 1/(SNR + 1) (v-prediction), SNR capped at 1000: kohya's "
        "--debiased_estimation_loss (Yu et al. 2023), which evens out how much each timestep is learned; after Min-SNR if both are on",
    )
    masked_loss_normalize_area: bool = option(
        False,
        help="with --masked_loss: a sample's loss is its mean over the mask's area instead of over the whole latent, so a small "
        "subject is learned as strongly as a large one (OneTrainer's normalize_masked_area_loss; kohya does not)",
    )
    masked_loss: bool = option(
        False,
        help="weight each latent pixel's loss by the item's loss mask (cached with sdxl_process_data_dir.py --mask_files or --alpha_mask: "
        "black = not learned), to train a subject without its background; items without a mask train everywhere (kohya's --masked_loss)",
    )

    def noise_settings(self) -> NoiseSettings:
        """The settings the objective's functions take: NoiseSettings' fields are named as these options."""
        return NoiseSettings(**{field.name: getattr(self, field.name) for field in dataclasses.fields(NoiseSettings)})

    def sampling_scheduler_overrides(self) -> dict:
        """The sampling scheduler must follow the training objective (v-prediction, zero terminal SNR)."""
        overrides = {"prediction_type": self.prediction_type}
        if self.zero_terminal_snr:
            overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        return overrides

    def problems(self) -> list[str]:
        """Values out of range, and timestep sampling and loss options that contradict each other or would change nothing."""
        problems = []
        if not 0 <= self.conditional_dropout_percent <= 1:
            problems.append(f"--conditional_dropout_percent is a share between 0 and 1 (0.1 = 10%), got {self.conditional_dropout_percent}")
        if self.min_snr_gamma < 0 or self.noise_offset < 0 or self.ip_noise_gamma < 0:
            problems.append("--min_snr_gamma, --noise_offset and --ip_noise_gamma must be >= 0 (0 turns them off)")
        if not 0 <= self.min_timestep < self.max_timestep <= 1000:
            problems.append(f"need 0 <= --min_timestep < --max_timestep <= 1000, got {self.min_timestep} and {self.max_timestep}")
        if self.zero_terminal_snr and self.prediction_type != "v_prediction":
            problems.append("--zero_terminal_snr needs --prediction_type v_prediction (epsilon cannot be predicted at zero SNR)")
        if not self.logit_std > 0:
            problems.append(f"--logit_std must be > 0, got {self.logit_std}")
        strategy = self.timestep_bias_strategy
        placed = 0 <= self.min_timestep < self.max_timestep <= 1000  # else the range is named above
        if strategy in ("earlier", "later") and not 0 < self.timestep_bias_portion < 1:
            problems.append(f"--timestep_bias_portion is a share between 0 and 1 (exclusive) of the timesteps to bias, got {self.timestep_bias_portion}")
            placed = False
        if strategy == "range" and not 0 <= self.timestep_bias_begin < self.timestep_bias_end <= 1000:
            problems.append(f"need 0 <= --timestep_bias_begin < --timestep_bias_end <= 1000, got {self.timestep_bias_begin} and {self.timestep_bias_end}")
            placed = False
        if strategy != "none" and (self.timestep_bias_multiplier < 0 or self.timestep_bias_multiplier == 1):
            problems.append(f"--timestep_bias_multiplier must be >= 0 and not 1 (1 biases nothing), got {self.timestep_bias_multiplier}")
        if strategy != "none" and placed:
            biased = biased_timesteps(self.noise_settings())
            drawn = range(self.min_timestep, self.max_timestep)
            inside = len(range(max(biased.start, drawn.start), min(biased.stop, drawn.stop)))
            if inside in (0, len(drawn)):
                problems.append(
                    f"--timestep_bias_strategy {strategy} biases timesteps [{biased.start}, {biased.stop}), which hold "
                    f"{'none' if inside == 0 else 'all'} of the drawn [{self.min_timestep}, {self.max_timestep}), so it changes nothing: "
                    "move the bias or the --min_timestep / --max_timestep range"
                )
            elif self.logit_std > 0 and not np.isfinite(timestep_weights(self.noise_settings())).all():
                problems.append("no timestep is left to draw: the logit-normal weight outside the zero-multiplier bias is 0; widen --logit_std")
        if not (self.huber_c > 0 and (self.huber_schedule == "constant" or self.huber_c <= 1)):
            problems.append(f"--huber_c must be > 0, and at most 1 with --huber_schedule {self.huber_schedule} (it runs from 1 down to huber_c), got {self.huber_c}")
        defaults = {field.name: field.default for field in dataclasses.fields(ObjectiveOptions)}
        needs = {  # option: (what it needs, whether that is on)
            "noise_offset_random_strength": ("--noise_offset", self.noise_offset > 0),
            "ip_noise_gamma_random_strength": ("--ip_noise_gamma", self.ip_noise_gamma > 0),
            "logit_mean": ("--timestep_sampling logit_normal", self.timestep_sampling == "logit_normal"),
            "logit_std": ("--timestep_sampling logit_normal", self.timestep_sampling == "logit_normal"),
            "timestep_bias_multiplier": ("a --timestep_bias_strategy", strategy != "none"),
            "timestep_bias_portion": ("--timestep_bias_strategy earlier or later", strategy in ("earlier", "later")),
            "timestep_bias_begin": ("--timestep_bias_strategy range", strategy == "range"),
            "timestep_bias_end": ("--timestep_bias_strategy range", strategy == "range"),
            "huber_schedule": ("--loss_type huber or smooth_l1", self.loss_type in ("huber", "smooth_l1")),
            "huber_c": ("--loss_type huber or smooth_l1", self.loss_type in ("huber", "smooth_l1")),
            "masked_loss_normalize_area": ("--masked_loss", self.masked_loss),
        }
        for name, (needed, on) in needs.items():
            if not on and getattr(self, name) != defaults[name]:
                problems.append(f"--{name} has no effect without {needed}")
        return problems
