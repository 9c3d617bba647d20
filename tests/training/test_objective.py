"""The training objective's options, in this process: the timestep distributions (bias, logit-normal) as
drawn, sample by sample, from the per-(seed, epoch, sample) generators; the loss types and Huber
thresholds against hand computations (with v-prediction and Min-SNR) and their gradients; debiased
estimation's weights; input perturbation and random noise-offset strength replayed draw by draw from the
sample's generator; validation loss untouched by them; and the configuration checks of these options."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sdxl_trainer.config import parse_config
from sdxl_trainer.training.loss import build_noise_scheduler, huber_thresholds, sample_losses, training_loss
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import draw_sample_randomness, sample_generator
from sdxl_trainer.training.timesteps import timestep_weights


def chi_square(counts: np.ndarray, probabilities: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities, over the bins expected to hold at
    least 5 draws, and its degrees of freedom."""
    expected = probabilities * counts.sum()
    kept = expected >= 5
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()), int(kept.sum()) - 1


def assert_fits(counts: np.ndarray, probabilities: np.ndarray) -> None:
    """The counts are a sample of the probabilities: chi-square below its mean plus 6 standard deviations
    (the draws are seeded, so this is no flaky bound; a wrong distribution lands far above it)."""
    statistic, dof = chi_square(counts, probabilities)
    assert statistic < dof + 6 * (2 * dof) ** 0.5, (statistic, dof)


def drawn_timesteps(settings: NoiseSettings, samples: int, epoch: int = 0) -> np.ndarray:
    """Each sample's timestep as training draws it: from its own (seed, epoch, sample) generator."""
    latents = torch.zeros(samples, 4, 1, 1)
    return draw_sample_randomness(latents, torch.arange(samples), 11, epoch, settings).timesteps.numpy()


# --- timestep weights by hand ---------------------------------------------------------------------------


def test_bias_weights_by_hand():
    """diffusers' generate_timestep_weights: ones, the chosen slice times the multiplier, normalised."""
    later = timestep_weights(NoiseSettings(0.0, timestep_bias_strategy="later", timestep_bias_multiplier=3.0, timestep_bias_portion=0.25))
    expected = np.r_[np.ones(750), np.full(250, 3.0)] / (750 + 3 * 250)
    np.testing.assert_allclose(later, expected, rtol=1e-12)

    earlier = timestep_weights(NoiseSettings(0.0, timestep_bias_strategy="earlier", timestep_bias_multiplier=0.5, timestep_bias_portion=0.1))
    np.testing.assert_allclose(earlier, np.r_[np.full(100, 0.5), np.ones(900)] / (50 + 900), rtol=1e-12)

    # range [200, 300) with multiplier 0 inside a drawn [100, 400): only 100-199 and 300-399, equally.
    hole = timestep_weights(NoiseSettings(0.0, min_timestep=100, max_timestep=400, timestep_bias_strategy="range",
                                          timestep_bias_multiplier=0.0, timestep_bias_begin=200, timestep_bias_end=300))
    expected = np.zeros(1000)
    expected[100:200] = expected[300:400] = 1 / 200
    np.testing.assert_allclose(hole, expected, rtol=1e-12)


def test_logit_normal_weights_are_the_distribution_of_onetrainers_draw():
    """OneTrainer's discrete LOGIT_NORMAL draws x ~ N(mean, std) and takes min + int(sigmoid(x) * (max - min));
    timestep_weights must be that distribution exactly (here against 2 million of those draws)."""
    settings = NoiseSettings(0.0, min_timestep=100, max_timestep=900, timestep_sampling="logit_normal", logit_mean=0.4, logit_std=1.3)
    x = np.random.default_rng(0).normal(0.4, 1.3, 2_000_000)
    onetrainer = 100 + (800 / (1 + np.exp(-x))).astype(np.int64)
    weights = timestep_weights(settings)
    assert weights[:100].sum() == 0 and weights[900:].sum() == 0
    assert_fits(np.bincount(onetrainer, minlength=1000), weights)
    # The median is sigmoid(mean) of the way through the range (not its middle): the mean moves the draws.
    assert np.searchsorted(np.cumsum(weights), 0.5) == int(100 + 800 / (1 + np.exp(-0.4)))


# --- the draws, sample by sample ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        NoiseSettings(0.0, timestep_bias_strategy="later", timestep_bias_multiplier=4.0, timestep_bias_portion=0.3),
        NoiseSettings(0.0, timestep_sampling="logit_normal", logit_mean=-0.5, logit_std=0.8),
        NoiseSettings(0.0, min_timestep=50, max_timestep=950, timestep_sampling="logit_normal", timestep_bias_strategy="range",
                      timestep_bias_begin=400, timestep_bias_end=600, timestep_bias_multiplier=0.0),
    ],
    ids=["later", "logit_normal", "logit_normal_with_a_hole"],
)
def test_sampled_timesteps_follow_the_intended_distribution(settings):
    """20000 samples' timesteps, each from its own generator, in 50 bins of 20 timesteps: a fit to the weights."""
    drawn = drawn_timesteps(settings, 20_000)
    weights = timestep_weights(settings)
    assert weights[drawn].min() > 0  # nothing outside the support, e.g. the zero-multiplier hole
    assert_fits(np.bincount(drawn // 20, minlength=50), weights.reshape(50, 20).sum(axis=1))


def test_the_bias_changes_the_histogram_as_asked():
    """'later' x4 on the last 30%: those 300 timesteps hold 4*300 / (700 + 4*300) = 63% of the draws."""
    drawn = drawn_timesteps(NoiseSettings(0.0, timestep_bias_strategy="later", timestep_bias_multiplier=4.0, timestep_bias_portion=0.3), 10_000)
    assert np.mean(drawn >= 700) == pytest.approx(1200 / 1900, abs=0.015)
    uniform = drawn_timesteps(NoiseSettings(0.0), 10_000)
    assert np.mean(uniform >= 700) == pytest.approx(0.3, abs=0.015)


def test_timestep_draws_are_reproducible_per_seed_epoch_and_sample():
    """A sample's timestep depends only on (seed, epoch, sample): the same in any batch, different next epoch."""
    settings = NoiseSettings(0.0, timestep_sampling="logit_normal", timestep_bias_strategy="earlier", timestep_bias_multiplier=2.0)
    together = drawn_timesteps(settings, 64)
    alone = [draw_sample_randomness(torch.zeros(1, 4, 1, 1), torch.tensor([item]), 11, 0, settings).timesteps.item() for item in (5, 63, 0)]
    assert alone == [together[5], together[63], together[0]]
    assert not np.array_equal(drawn_timesteps(settings, 64, epoch=1), together)


def test_plain_uniform_draws_are_those_of_earlier_versions():
    """Without bias or logit-normal the timestep is still numpy's integers() draw, so a resume of a run
    started before these options continues with the same noise and timesteps (and validation keeps its own)."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([11, 0, 7])))
    generator.standard_normal((4, 1, 1), dtype=np.float32)
    assert drawn_timesteps(NoiseSettings(0.0, min_timestep=10, max_timestep=990), 8)[7] == generator.integers(10, 990, (1,), dtype=np.int64)[0]


# --- loss types -----------------------------------------------------------------------------------------


class ConstantUNet(torch.nn.Module):
    """Predicts 0.3 everywhere, so prediction - target spans both sides of a Huber threshold."""

    def forward(self, sample, timestep, encoder_hidden_states, added_cond_kwargs):
        return type("Output", (), {"sample": torch.full_like(sample, 0.3)})


def objective_batch(samples: int = 4) -> dict[str, torch.Tensor]:
    return {
        "latents": torch.randn(samples, 4, 6, 5, generator=torch.Generator().manual_seed(2)),
        "sample_index": torch.arange(10, 10 + samples),
        "prompt_embeds": torch.zeros(samples, 77, 32),
        "pooled_prompt_embeds": torch.zeros(samples, 32),
        "time_ids": torch.zeros(samples, 6),
    }


def kohya_threshold(schedule: str, c: float, t: int, alpha_bar: float) -> float:
    """kohya's get_huber_threshold_if_needed (library/train_util.py), one timestep, in plain floats."""
    if schedule == "constant":
        return c
    if schedule == "exponential":
        alpha = -math.log(c) / 1000
        return math.exp(-alpha * t)
    sigma = ((1.0 - alpha_bar) / alpha_bar) ** 0.5
    return (1 - c) / (1 + sigma) ** 2 + c


def hand_loss(d: np.ndarray, loss_type: str, c: float) -> float:
    """kohya's conditional_loss of one sample, mean over its elements, in float64."""
    if loss_type == "l2":
        return float(np.mean(d**2))
    if loss_type == "l1":
        return float(np.mean(np.abs(d)))
    smooth = 2 * (np.sqrt(d**2 + c**2) - c)
    return float(np.mean(c * smooth if loss_type == "huber" else smooth))


@pytest.fixture(scope="module")
def schedulers(tiny_pipeline_dir):
    return {kind: build_noise_scheduler(str(tiny_pipeline_dir), kind, zero_terminal_snr=False) for kind in ("epsilon", "v_prediction")}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize(
    "loss_type,schedule,min_snr_gamma",
    [("l2", "snr", 0.0), ("l1", "snr", 5.0), ("huber", "constant", 0.0), ("huber", "exponential", 5.0), ("huber", "snr", 5.0), ("smooth_l1", "snr", 0.0),
     ("smooth_l1", "exponential", 0.0)],
)
def test_loss_types_by_hand(schedulers, prediction_type, loss_type, schedule, min_snr_gamma):
    """training_loss equals, per sample: the target by hand (noise, or v = sqrt(a) noise - sqrt(1 - a) x0),
    kohya's threshold and elementwise loss, the mean, times min(SNR, gamma) / SNR (or / (SNR + 1) for v)."""
    scheduler = schedulers[prediction_type]
    batch = objective_batch()
    settings = NoiseSettings(0.0, loss_type=loss_type, huber_schedule=schedule, huber_c=0.3, min_snr_gamma=min_snr_gamma)
    loss = training_loss(ConstantUNet(), batch, scheduler, (torch.zeros(77, 32), torch.zeros(32)), 9, 2, settings)

    randomness = draw_sample_randomness(batch["latents"], batch["sample_index"], 9, 2, settings)
    expected = []
    for sample in range(4):
        t = int(randomness.timesteps[sample])
        a = float(scheduler.alphas_cumprod[t])
        noise, x0 = randomness.noise[sample].double().numpy(), batch["latents"][sample].double().numpy()
        target = noise if prediction_type == "epsilon" else math.sqrt(a) * noise - math.sqrt(1 - a) * x0
        value = hand_loss(0.3 - target, loss_type, kohya_threshold(schedule, 0.3, t, a))
        if min_snr_gamma:
            snr = a / (1 - a)
            value *= min(snr, min_snr_gamma) / (snr + 1 if prediction_type == "v_prediction" else snr)
        expected.append(value)
    assert loss.item() == pytest.approx(np.mean(expected), rel=1e-5)


def test_huber_thresholds_follow_kohyas_schedules(schedulers):
    scheduler = schedulers["epsilon"]
    timesteps = torch.tensor([0, 250, 500, 999])
    for schedule in ("constant", "exponential", "snr"):
        got = huber_thresholds(scheduler, timesteps, NoiseSettings(0.0, loss_type="huber", huber_schedule=schedule, huber_c=0.1))
        hand = [kohya_threshold(schedule, 0.1, t, float(scheduler.alphas_cumprod[t])) for t in timesteps.tolist()]
        assert got.tolist() == pytest.approx(hand, rel=1e-6)
    exponential = huber_thresholds(scheduler, timesteps, NoiseSettings(0.0, huber_schedule="exponential", huber_c=0.1))
    assert exponential[0].item() == 1.0 and exponential[2].item() == pytest.approx(0.1**0.5)  # 1 at t = 0, c^(t/1000)
    snr = huber_thresholds(scheduler, timesteps, NoiseSettings(0.0, huber_schedule="snr", huber_c=0.1))
    assert 0.9 < snr[0].item() and snr[-1].item() < 0.11 and bool((snr.diff() < 0).all())  # MSE-like at low noise, c at high


def test_huber_bounds_an_outliers_gradient_where_l2_does_not(schedulers):
    """One element 100 off: its gradient is 2d/N under l2 but under huber 2c d / sqrt(d^2 + c^2) / N, at most 2c/N;
    an element far inside the threshold gets (nearly) the l2 gradient."""
    target = torch.zeros(1, 4, 4, 4)
    n = target.numel()
    for loss_type, outlier_gradient, small_gradient in (("l2", 200 / n, 2e-3 / n), ("huber", 2 * 0.5 * 100 / math.hypot(100, 0.5) / n, 2e-3 / n)):
        prediction = torch.full((1, 4, 4, 4), 1e-3)
        prediction[0, 0, 0, 0] = 100.0
        prediction.requires_grad_(True)
        settings = NoiseSettings(0.0, loss_type=loss_type, huber_schedule="constant", huber_c=0.5)
        sample_losses(prediction, target, torch.tensor([500]), schedulers["epsilon"], settings).sum().backward()
        assert prediction.grad[0, 0, 0, 0].item() == pytest.approx(outlier_gradient, rel=1e-5)
        assert prediction.grad[0, 1, 1, 1].item() == pytest.approx(small_gradient, rel=1e-4)


def test_validation_loss_keeps_its_fixed_timesteps_and_plain_mse(sample_cache_dir, schedulers):
    """Whatever the training options, val/loss is MSE at the fixed, stratified uniform timesteps of each
    held-out item (its own generator under the validation key): here recomputed item by item."""
    from sdxl_trainer.evaluation.validation import TIMESTEP_RANGES, VALIDATION_LOSS_KEY, loss_batches, validation_loss
    from sdxl_trainer.training.dataset import CachedDataset, collate

    class RecordingUNet(ConstantUNet):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, sample, timestep, encoder_hidden_states, added_cond_kwargs):
            self.seen.append(timestep.clone())
            return super().forward(sample, timestep, encoder_hidden_states, added_cond_kwargs)

    dataset = CachedDataset([sample_cache_dir])
    items = np.arange(min(len(dataset), 9))
    unet = RecordingUNet()
    result = validation_loss(unet, dataset, items, schedulers["epsilon"], seed=4, device=torch.device("cpu"), batch_size=2)
    squares, seen = [], []
    for range_index, batch_items in loss_batches(items, dataset.bucket_ids(), 2):
        low, high = TIMESTEP_RANGES[range_index]
        latents = collate([dataset[int(item)] for item in batch_items])["latents"].float()
        drawn = draw_sample_randomness(latents, torch.from_numpy(batch_items), 4, VALIDATION_LOSS_KEY, NoiseSettings(0.0, min_timestep=low, max_timestep=high))
        seen.append(drawn.timesteps)
        squares += (0.3 - drawn.noise).square().mean(dim=(1, 2, 3)).tolist()
    assert torch.equal(torch.cat(unet.seen), torch.cat(seen))
    assert result["val/loss"] == pytest.approx(np.mean(squares), rel=1e-5)


# --- debiased estimation --------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_debiased_estimation_weights_by_hand(schedulers, prediction_type):
    """kohya's apply_debiased_estimation after Min-SNR: 1/sqrt(min(SNR, 1000)) for epsilon, 1/(min(SNR, 1000) + 1)
    for v; timestep 0 (SNR about 1175 in SDXL's schedule) meets the cap."""
    scheduler = schedulers[prediction_type]
    timesteps = torch.tensor([0, 40, 500, 999])
    prediction, target = torch.full((4, 4, 3, 3), 0.5), torch.zeros(4, 4, 3, 3)  # l2 = 0.25 per sample
    settings = NoiseSettings(0.0, debiased_estimation_loss=True, min_snr_gamma=5.0)
    got = sample_losses(prediction, target, timesteps, scheduler, settings)
    expected = []
    for t in timesteps.tolist():
        a = float(scheduler.alphas_cumprod[t])
        snr = a / (1 - a)
        min_snr = min(snr, 5.0) / (snr + 1 if prediction_type == "v_prediction" else snr)
        capped = min(snr, 1000.0)
        debiased = 1 / (capped + 1) if prediction_type == "v_prediction" else 1 / math.sqrt(capped)
        expected.append(0.25 * min_snr * debiased)
    assert float(scheduler.alphas_cumprod[0] / (1 - scheduler.alphas_cumprod[0])) > 1000
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    plain = sample_losses(prediction, target, timesteps, scheduler, NoiseSettings(0.0, debiased_estimation_loss=True))
    assert bool((plain.diff() > 0).all())  # noisier timesteps weigh more


def test_weights_and_thresholds_stay_finite_at_zero_terminal_snr(tiny_pipeline_dir):
    """At SNR 0 (the last timestep with --zero_terminal_snr, v-prediction) the debiased weight is 1/(0 + 1) = 1,
    Min-SNR's (about) 0, and the snr schedule's Huber threshold c itself (sigma is (about) infinite)."""
    scheduler = build_noise_scheduler(str(tiny_pipeline_dir), "v_prediction", zero_terminal_snr=True)
    timesteps = torch.tensor([999])
    settings = NoiseSettings(0.0, loss_type="huber", huber_schedule="snr", huber_c=0.1, debiased_estimation_loss=True)
    assert huber_thresholds(scheduler, timesteps, settings).item() == pytest.approx(0.1, abs=1e-6)
    loss = sample_losses(torch.full((1, 4, 2, 2), 0.5), torch.zeros(1, 4, 2, 2), timesteps, scheduler, settings)
    assert loss.item() == pytest.approx(0.2 * (math.sqrt(0.25 + 0.01) - 0.1), rel=1e-5)  # weight 1
    with_min_snr = sample_losses(torch.full((1, 4, 2, 2), 0.5), torch.zeros(1, 4, 2, 2), timesteps, scheduler,
                                 NoiseSettings(0.0, loss_type="huber", debiased_estimation_loss=True, min_snr_gamma=5.0))
    assert torch.isfinite(with_min_snr).all() and with_min_snr.item() < 1e-5


# --- input perturbation and random strengths -------------------------------------------------------------


def replayed_draws(seed: int, epoch: int, sample: int, shape: tuple, offset: float, offset_random: bool, gamma: float, gamma_random: bool):
    """One sample's draws, replayed by hand from its generator in the documented order: noise, timestep,
    caption dropout, offset (per-channel normals, then its strength), perturbation (normals, then its strength)."""
    generator = sample_generator(seed, epoch, sample)
    noise = generator.standard_normal(shape, dtype=np.float32)
    timestep = generator.integers(0, 1000, (1,), dtype=np.int64)
    generator.random(1)
    offsets = generator.standard_normal((shape[0], 1, 1), dtype=np.float32)
    noise = noise + np.float32(offset * (generator.random() if offset_random else 1.0)) * offsets
    perturbation = generator.standard_normal(shape, dtype=np.float32)
    input_noise = noise + np.float32(gamma * (generator.random() if gamma_random else 1.0)) * perturbation
    return noise, timestep, input_noise


@pytest.mark.parametrize("offset_random,gamma_random", [(False, False), (True, True)])
def test_noise_offset_and_input_perturbation_by_hand(offset_random, gamma_random):
    settings = NoiseSettings(0.0, noise_offset=0.1, noise_offset_random_strength=offset_random, ip_noise_gamma=0.2, ip_noise_gamma_random_strength=gamma_random)
    latents = torch.zeros(3, 4, 5, 6)
    drawn = draw_sample_randomness(latents, torch.tensor([7, 2, 30]), 5, 3, settings)
    for row, sample in enumerate((7, 2, 30)):
        noise, timestep, input_noise = replayed_draws(5, 3, sample, (4, 5, 6), 0.1, offset_random, 0.2, gamma_random)
        torch.testing.assert_close(drawn.noise[row], torch.from_numpy(noise), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(drawn.input_noise[row], torch.from_numpy(input_noise), rtol=1e-6, atol=1e-6)
        assert drawn.timesteps[row].item() == timestep[0]


def test_random_strengths_are_uniform_per_sample():
    """With random strength each sample's offset std and gamma are U(0, max): the input perturbation's
    per-sample std over gamma spreads evenly over (0, 1), and the mean size of the offsets halves."""
    samples = 400
    latents = torch.zeros(samples, 4, 16, 16)
    items = torch.arange(samples)
    fixed = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0, noise_offset=0.1, ip_noise_gamma=0.2))
    drawn = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0, noise_offset=0.1, noise_offset_random_strength=True,
                                                                         ip_noise_gamma=0.2, ip_noise_gamma_random_strength=True))
    assert torch.allclose((fixed.input_noise - fixed.noise).std(dim=(1, 2, 3)), torch.tensor(0.2), rtol=0.15)
    strengths = np.sort(((drawn.input_noise - drawn.noise).std(dim=(1, 2, 3)) / 0.2).numpy())
    assert np.abs(strengths - (np.arange(samples) + 0.5) / samples).max() < 0.1  # the quantiles of U(0, 1)
    plain = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0))
    fixed_size = (fixed.noise - plain.noise).abs().mean().item()
    random_size = (drawn.noise - plain.noise).abs().mean().item()
    assert random_size / fixed_size == pytest.approx(0.5, abs=0.06)


def test_input_perturbation_noises_the_input_and_leaves_the_target(schedulers):
    """The UNet sees sqrt(a) x0 + sqrt(1 - a) (noise + gamma * perturbation); the loss is against the noise."""
    scheduler = schedulers["epsilon"]
    seen = []

    class InputRecordingUNet(torch.nn.Module):
        def forward(self, sample, timestep, encoder_hidden_states, added_cond_kwargs):
            seen.append(sample.clone())
            return type("Output", (), {"sample": torch.zeros_like(sample)})

    batch = objective_batch()
    settings = NoiseSettings(0.0, ip_noise_gamma=0.5)
    loss = training_loss(InputRecordingUNet(), batch, scheduler, (torch.zeros(77, 32), torch.zeros(32)), 9, 2, settings)
    drawn = draw_sample_randomness(batch["latents"], batch["sample_index"], 9, 2, settings)
    a = scheduler.alphas_cumprod[drawn.timesteps].view(-1, 1, 1, 1)
    torch.testing.assert_close(seen[0], a.sqrt() * batch["latents"] + (1 - a).sqrt() * drawn.input_noise, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(drawn.input_noise, drawn.noise)
    assert loss.item() == pytest.approx(drawn.noise.square().mean().item(), rel=1e-5)


def test_every_draw_is_reproducible_per_seed_epoch_and_sample_and_options_leave_earlier_draws_alone():
    """Alone or in a batch, in any order, a sample draws the same; another epoch draws anew; turning on
    input perturbation or random strengths leaves the noise, timestep and caption dropout as they were."""
    everything = NoiseSettings(0.5, noise_offset=0.1, noise_offset_random_strength=True, ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True,
                               timestep_sampling="logit_normal", timestep_bias_strategy="later", timestep_bias_multiplier=2.0)
    latents = torch.zeros(6, 4, 3, 3)
    batch = draw_sample_randomness(latents, torch.tensor([0, 1, 2, 3, 4, 5]), 8, 1, everything)
    reversed_order = draw_sample_randomness(latents, torch.tensor([5, 4, 3, 2, 1, 0]), 8, 1, everything)
    alone = draw_sample_randomness(latents[:1], torch.tensor([3]), 8, 1, everything)
    for field in ("noise", "timesteps", "drop_caption", "input_noise"):
        assert torch.equal(getattr(batch, field), getattr(reversed_order, field).flip(0))
        assert torch.equal(getattr(batch, field)[3:4], getattr(alone, field))
    assert not torch.equal(draw_sample_randomness(latents, torch.arange(6), 8, 2, everything).input_noise, batch.input_noise)
    without = draw_sample_randomness(latents, torch.arange(6), 8, 1, NoiseSettings(0.5, noise_offset=0.1, timestep_sampling="logit_normal",
                                                                                 timestep_bias_strategy="later", timestep_bias_multiplier=2.0))
    assert torch.equal(without.timesteps, batch.timesteps) and torch.equal(without.drop_caption, batch.drop_caption)
    assert torch.equal(without.input_noise, without.noise)


# --- per-dataset loss weights (--dataset_loss_weights) --------------------------------------------------


class ScaleUNet(torch.nn.Module):
    """Predicts the noisy input times one weight, so a sample's loss and gradient are easy to compare."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.7))
        # The widths objective_batch's caption embeddings have (the empty prompt is made to match them).
        self.config = SimpleNamespace(cross_attention_dim=32, projection_class_embeddings_input_dim=32 + 6 * 8, addition_time_embed_dim=8)

    def forward(self, sample, timestep, encoder_hidden_states, added_cond_kwargs):
        return type("Output", (), {"sample": sample * self.scale})


def test_dataset_loss_weights_weight_each_samples_loss_and_gradient_in_the_update(world, tiny_pipeline_dir):
    """Two samples from caches weighted 1 and 0.25: the update's loss is (l0 + 0.25 l1) / 2 and its gradient
    (g0 + 0.25 g1) / 2, where l_i and g_i are each sample's own, from an update of it alone (its noise and
    timestep come from its own generator, so they are the same in both)."""
    from unet_batches import make_train_step

    unet = ScaleUNet()
    step = make_train_step(unet, torch.optim.SGD(unet.parameters(), lr=0.0), tiny_pipeline_dir, max_grad_norm=0.0)
    batch = objective_batch(2)
    alone = [step([{key: value[i : i + 1] for key, value in batch.items()}], epoch=0) for i in range(2)]
    gradients = []
    for result in alone:
        assert result.stepped
    for i in range(2):  # the gradient's sign, which the update's norm drops: recomputed with autograd
        loss = training_loss(unet, {key: value[i : i + 1] for key, value in batch.items()}, step.noise_scheduler, step.empty_prompt, step.run_seed, 0, step.noise_settings)
        gradients.append(torch.autograd.grad(loss, unet.scale)[0].item())
    assert [abs(gradient) for gradient in gradients] == pytest.approx([result.grad_norm for result in alone], rel=1e-5)

    weighted = step([{**batch, "loss_weight": torch.tensor([1.0, 0.25])}], epoch=0)
    assert weighted.loss == pytest.approx((alone[0].loss + 0.25 * alone[1].loss) / 2, rel=1e-5)
    assert weighted.grad_norm == pytest.approx(abs(gradients[0] + 0.25 * gradients[1]) / 2, rel=1e-5)
    unweighted = step([batch], epoch=0)
    assert unweighted.loss == pytest.approx((alone[0].loss + alone[1].loss) / 2, rel=1e-5)
    assert weighted.loss < unweighted.loss


def test_each_cache_hands_its_loss_weight_to_its_items(sample_cache_dir):
    from sdxl_trainer.training.dataset import CachedDataset, collate

    plain = CachedDataset([sample_cache_dir, sample_cache_dir])
    assert "loss_weight" not in plain[0]
    weighted = CachedDataset([sample_cache_dir, sample_cache_dir], loss_weights=[1.0, 0.25])
    half = len(weighted) // 2
    assert [weighted[i]["loss_weight"].item() for i in (0, half - 1, half, len(weighted) - 1)] == [1.0, 1.0, 0.25, 0.25]
    assert collate([weighted[0], weighted[half]])["loss_weight"].tolist() == [1.0, 0.25]
    assert weighted[half + 2 * len(weighted)]["loss_weight"].item() == 0.25  # a repeat's copy keeps its cache's weight


# --- configuration --------------------------------------------------------------------------------------


def train_config(*flags: str):
    from sdxl_trainer.jobs.train_config import TrainConfig

    return parse_config(TrainConfig, ["--cached_dataset_dirs", "c", *flags])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "-1"], "--timestep_bias_multiplier must be >= 0 and not 1"),
        (["--timestep_bias_strategy", "later"], "--timestep_bias_multiplier must be >= 0 and not 1 (1 biases nothing)"),
        (["--timestep_bias_strategy", "earlier", "--timestep_bias_multiplier", "2", "--timestep_bias_portion", "1.5"], "--timestep_bias_portion is a share"),
        (["--timestep_bias_strategy", "range", "--timestep_bias_multiplier", "2", "--timestep_bias_begin", "600", "--timestep_bias_end", "500"],
         "need 0 <= --timestep_bias_begin < --timestep_bias_end <= 1000"),
        (["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "2", "--max_timestep", "700"],
         "biases timesteps [750, 1000), which hold none of the drawn [0, 700)"),
        (["--timestep_bias_strategy", "range", "--timestep_bias_multiplier", "0", "--timestep_bias_begin", "0", "--timestep_bias_end", "1000"],
         "which hold all of the drawn [0, 1000)"),
        (["--timestep_sampling", "logit_normal", "--logit_std", "0"], "--logit_std must be > 0"),
        (["--logit_mean", "0.5"], "--logit_mean has no effect without --timestep_sampling logit_normal"),
        (["--timestep_bias_portion", "0.5"], "--timestep_bias_portion has no effect without --timestep_bias_strategy earlier or later"),
        (["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "2", "--timestep_bias_end", "900"],
         "--timestep_bias_end has no effect without --timestep_bias_strategy range"),
        (["--loss_type", "huber", "--huber_c", "0"], "--huber_c must be > 0"),
        (["--loss_type", "huber", "--huber_c", "2"], "at most 1 with --huber_schedule snr"),
        (["--huber_schedule", "constant"], "--huber_schedule has no effect without --loss_type huber or smooth_l1"),
        (["--ip_noise_gamma", "-0.1"], "--ip_noise_gamma must be >= 0"),
        (["--ip_noise_gamma_random_strength"], "--ip_noise_gamma_random_strength has no effect without --ip_noise_gamma"),
        (["--noise_offset_random_strength"], "--noise_offset_random_strength has no effect without --noise_offset"),
        (["--masked_loss_normalize_area"], "--masked_loss_normalize_area has no effect without --masked_loss"),
        (["--dataset_loss_weights", "1", "2"], "--dataset_loss_weights needs one number per --cached_dataset_dirs entry (1), got 2"),
        (["--dataset_loss_weights", "0"], "--dataset_loss_weights must be > 0 and finite (leave a cache out instead of 0), got [0.0]"),
    ],
)
def test_config_rejects_timestep_options_that_contradict_or_do_nothing(flags, message, capsys):
    with pytest.raises(SystemExit):
        train_config(*flags)
    assert message in capsys.readouterr().err


def test_config_hands_its_objective_options_to_the_draws():
    config = train_config("--timestep_sampling", "logit_normal", "--logit_mean", "0.3", "--timestep_bias_strategy", "range",
                          "--timestep_bias_multiplier", "0", "--timestep_bias_begin", "0", "--timestep_bias_end", "100")
    settings = config.noise_settings()
    assert (settings.timestep_sampling, settings.logit_mean, settings.timestep_bias_end) == ("logit_normal", 0.3, 100)
    assert timestep_weights(settings)[:100].sum() == 0 and timestep_weights(settings)[100:].min() > 0
