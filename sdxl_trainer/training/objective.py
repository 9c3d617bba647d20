"""The denoising objective: per-sample noise, timesteps and caption dropout, the prediction target and the loss.

Every random draw for a sample comes from its own generator seeded by (run seed, epoch, sample index),
not from the rank's global RNG: numpy's PCG64 (128-bit state) seeded through a SeedSequence, which hashes
the three numbers, so no two (run, epoch, sample) share their draws. (torch's CPU generator keeps only 32
bits of a seed: with a linear seed, item i+2 in epoch e+2 repeated item i's noise of epoch e.) The sample
index is the item's for its first copy in an epoch, so a repeated item's copies (--dataset_repeats,
data.py) get draws of their own. So a sample gets the same noise whichever rank or microbatch it lands
in, which makes runs on 1 and N processes comparable step by step, and resumed runs identical to straight
ones. A draw an option adds comes after those of the options before it, and only with the option on, so
a sample's other draws stay what they were without it.

Timesteps. Uniform in [min_timestep, max_timestep) by default. --timestep_sampling logit_normal and
--timestep_bias_strategy instead give each of the 1000 timesteps a weight (timestep_weights) and a
sample's timestep is the inverse CDF of one uniform draw, which is torch.multinomial's distribution
(diffusers' SDXL example and SimpleTuner draw biased timesteps with it) from a generator of our own.

Noise. Each sample's noise, the target's, may carry a per-channel offset (--noise_offset, Guttenberg
2023) whose strength can itself be drawn (--noise_offset_random_strength, kohya's flag). Input
perturbation (--ip_noise_gamma; Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in Diffusion
Models") noises the UNet's input with that noise plus gamma times a second draw, while the target keeps
the first: kohya's noise + strength * randn_like, optionally with a drawn strength. kohya draws the two
random strengths once per batch; here each sample draws its own, so they too follow (seed, epoch, sample).

Loss. Each sample's loss is an elementwise loss of prediction minus target (--loss_type: l2 = squared
error, l1, or kohya's pseudo-Huber "huber" and "smooth_l1" with a threshold per timestep, see
huber_thresholds), times the sample's loss mask if it has one (--masked_loss), averaged over the latent,
then weighted per sample: Min-SNR, then debiased estimation; the microbatch's loss is the mean over its samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from sdxl_trainer.cache.format import LOSS_MASK_KEY
from sdxl_trainer.config import option
from sdxl_trainer.training.dataset import choose_views

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import DDPMScheduler

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


def build_noise_scheduler(base_model: str, prediction_type: PredictionType, zero_terminal_snr: bool) -> DDPMScheduler:
    """The base model's training noise schedule, optionally rescaled to zero terminal SNR
    (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"), which needs
    v-prediction because epsilon is undefined at SNR 0."""
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_pretrained(
        base_model, subfolder="scheduler", prediction_type=prediction_type, rescale_betas_zero_snr=zero_terminal_snr
    )


def sample_generator(run_seed: int, epoch: int, sample_index: int) -> np.random.Generator:
    """The generator of one sample's draws in one epoch (see the module docstring)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([run_seed, epoch, sample_index])))


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
