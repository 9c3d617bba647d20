"""Image metrics on random networks of the real architectures: each against a reference computation on fixed
inputs, and the weight resolution (explicit path, cache, missing -> warning or error, tensors-only loading)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import open_clip
import pytest
import scipy.linalg
import torch
from metric_networks import TINY_CLIP, register_tiny_clip, write_metric_weights
from PIL import Image
from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric

from sdxl_trainer.evaluation.metrics import (
    ALEXNET_FILE,
    ALEXNET_URL,
    HPS_FILE,
    INCEPTION_FILE,
    URL_INCEPTION_V3,
    MetricSkipped,
    MetricWeights,
    MetricWeightsError,
    frechet_distance,
    load_image_metrics,
)


def test_the_weight_addresses_are_the_libraries_own():
    """metrics.py spells them out so that a start refused before the models load never imports torchvision or
    torch-fidelity (test_launch.py checks that it does not)."""
    import torchvision
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3 as torch_fidelity_url

    assert URL_INCEPTION_V3 == torch_fidelity_url
    assert ALEXNET_URL == torchvision.models.AlexNet_Weights.IMAGENET1K_V1.url


CAPTIONS = ["a red circle", "a blue square on grey", "stripes", "a green field at dusk"]


def images(seed: int, sizes=((64, 96),) * 3 + ((80, 80),)) -> list[torch.Tensor]:
    """Smooth random colour fields (not white noise, so the networks see structure), uint8 (3, H, W)."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for height, width in sizes:
        coarse = torch.rand(1, 3, 6, 6, generator=generator)
        result.append((torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic").clamp(0, 1)[0] * 255).round().to(torch.uint8))
    return result


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> MetricWeights:
    return write_metric_weights(tmp_path_factory.mktemp("metric_weights"))


@pytest.fixture(scope="module")
def metrics(weights):
    return load_image_metrics(weights, allow_download=False, hps_architecture=TINY_CLIP)


@pytest.mark.slow
def test_all_metrics_load_from_explicit_files(metrics):
    assert metrics.enabled == ("fid", "kid", "is", "lpips", "hpsv2") and not metrics.skipped


def noise_images(seed: int) -> list[torch.Tensor]:
    """Pixel noise: as far from the smooth fields of images() as these networks can tell."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, image.shape, dtype=torch.uint8, generator=generator) for image in images(0)]


def unbiased_kid(x: torch.Tensor, y: torch.Tensor) -> float:
    """KID's unbiased MMD^2 with the cubic polynomial kernel (x.y / d + 1)^3, over the whole sets."""
    kernel = lambda a, b: (a @ b.T / a.shape[1] + 1) ** 3  # noqa: E731
    m = len(x)
    off_diagonal = lambda k: (k.sum() - k.diagonal().sum()) / (m * (m - 1))  # noqa: E731
    return float(off_diagonal(kernel(x, x)) + off_diagonal(kernel(y, y)) - 2 * kernel(x, y).mean())


@pytest.mark.slow
def test_scores_of_a_set_with_itself_and_with_a_different_set(metrics):
    real, noise = images(0), noise_images(1)
    itself = metrics.score(real, real, CAPTIONS)
    assert set(itself) == {"val/fid", "val/kid", "val/is", "val/lpips", "val/hpsv2"}
    assert itself["val/lpips"] == 0.0 and metrics.lpips(noise, real).min() > 0.05
    assert itself["val/is"] >= 1.0
    # FID and KID from features, so the (slow, 2048-wide) statistics of the noise set are computed once.
    real_pool, _ = metrics.inception_features(real)
    noise_pool, _ = metrics.inception_features(noise)
    different = metrics.summarize(real_pool, noise_pool, None, None, None)
    assert abs(itself["val/fid"]) < 1e-4 * different["val/fid"], (itself, different)
    assert abs(itself["val/kid"]) < 0.1 * different["val/kid"], (itself, different)
    # KID: with subsets as large as the sets, each of KID's 100 subsets is the whole set, so the mean is exact.
    assert itself["val/kid"] == pytest.approx(unbiased_kid(real_pool, real_pool), rel=1e-6, abs=1e-12)
    assert different["val/kid"] == pytest.approx(unbiased_kid(real_pool, noise_pool), rel=1e-6)


def test_inception_features_differ_between_images(metrics):
    pool, logits = metrics.inception_features(images(0))
    assert pool.shape == (4, 2048) and logits.shape == (4, 1008)
    assert pool.std(dim=0).mean() > 1e-3 * pool.abs().mean(), "a random Inception without Kaiming init gives the same features for every image"


@pytest.mark.slow
def test_fid_matches_the_textbook_formula(metrics):
    # The formula does not depend on the width: 64 feature dimensions keep the matrix square root quick.
    real, _ = metrics.inception_features(images(0) + images(2))
    fake, _ = metrics.inception_features(noise_images(1) + images(3)[:2])
    real, fake = real[:, :64], fake[:, :64]
    mu1, mu2 = real.mean(0).numpy(), fake.mean(0).numpy()
    sigma1, sigma2 = np.cov(real.numpy(), rowvar=False), np.cov(fake.numpy(), rowvar=False)
    root = scipy.linalg.sqrtm(sigma1 @ sigma2).real
    expected = float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1 + sigma2 - 2 * root))
    assert metrics.summarize(real, fake, None, None, None)["val/fid"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("real_count,fake_count,width", [(6, 9, 64), (50, 40, 64), (80, 100, 64)])
def test_fid_is_torch_fidelitys_in_its_low_rank_form_and_beyond(real_count, fake_count, width):
    """Sets smaller than the feature width take the exact low-rank form (the identity holds at any width; 64
    keeps torch-fidelity's eigenvalues quick); (80, 100, 64) is torch-fidelity's own path."""
    generator = torch.Generator().manual_seed(real_count)
    real = torch.rand(real_count, width, generator=generator) * 3
    fake = torch.rand(fake_count, width, generator=generator) * 3 + 0.1 * torch.randn(fake_count, width, generator=generator)
    expected = fid_statistics_to_metric(*[fid_features_to_statistics(features) for features in (real, fake)], verbose=False)
    assert frechet_distance(real, fake) == pytest.approx(expected["frechet_inception_distance"], rel=1e-6)
    assert frechet_distance(real, real) == pytest.approx(0.0, abs=1e-9 * frechet_distance(real, fake))


def test_inception_score_is_at_least_one_and_exactly_one_for_identical_images(metrics):
    _, logits = metrics.inception_features(images(0))
    assert metrics.summarize(None, None, logits, None, None)["val/is"] >= 1.0
    same = logits[:1].repeat(4, 1)
    assert metrics.summarize(None, None, same, None, None)["val/is"] == pytest.approx(1.0, abs=1e-9)


def test_hps_is_the_cosine_similarity_of_clip_embeddings(metrics):
    shots = images(4)
    got = metrics.hps(shots, CAPTIONS)
    model = metrics.hps_scorer.model
    preprocess = open_clip.image_transform(224, is_train=False, resize_mode="longest")  # HPSv2's: longest side + pad
    pixels = torch.stack([preprocess(Image.fromarray(image.permute(1, 2, 0).numpy())) for image in shots])
    with torch.no_grad():
        image_features = model.encode_image(pixels)
        text_features = model.encode_text(open_clip.get_tokenizer(TINY_CLIP)(CAPTIONS))
    expected = torch.nn.functional.cosine_similarity(image_features, text_features, dim=-1)
    assert torch.allclose(got.float(), expected, atol=1e-5)
    assert got.abs().max() <= 1.0


def test_hps_preprocessing_resizes_the_longest_side_and_pads_as_the_official_scorer(metrics):
    """A 300x150 bucket: scaled by 224/300 to 224x112, then 56 black rows above and below (the official
    HPSv2 transform); a centre crop would have cut off a quarter of the image on each side."""
    rng = np.random.default_rng(3)
    image = torch.from_numpy(rng.integers(0, 256, (150, 300, 3), dtype=np.uint8)).permute(2, 0, 1)
    got = metrics.hps_scorer.preprocess(image)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    resized = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((224, 112), Image.BICUBIC)
    middle = (torch.from_numpy(np.asarray(resized)).permute(2, 0, 1).float() / 255 - mean) / std
    black = (0 - mean) / std
    assert got.shape == (3, 224, 224)
    assert torch.allclose(got[:, 56:168], middle, atol=1e-6)
    assert torch.allclose(got[:, :56], black.expand(3, 56, 224)) and torch.allclose(got[:, 168:], black.expand(3, 56, 224))
    reference = open_clip.image_transform(224, is_train=False, resize_mode="longest")(Image.fromarray(image.permute(1, 2, 0).numpy()))
    assert torch.allclose(got, reference, atol=1e-6)  # open_clip's own "longest" mode agrees


# ---- weight resolution ---------------------------------------------------------------------------------


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_hub"))
    return tmp_path


def test_missing_weights_turn_metrics_off_with_one_warning_each(empty_caches):
    with pytest.warns(MetricSkipped) as caught:
        metrics = load_image_metrics(MetricWeights(), allow_download=False)
    assert metrics.enabled == ()
    assert set(metrics.skipped) == {"fid", "kid", "is", "lpips", "hpsv2"}
    assert len(caught) == 3  # one per network: Inception, AlexNet, HPS
    assert "--inception_weights" in str(caught[0].message) and "--hpsv2_checkpoint" in str(caught[2].message)


@pytest.mark.parametrize(
    "weights,required,flag",
    [
        (MetricWeights(), ["fid"], "--inception_weights"),
        (MetricWeights(), ["lpips"], "--lpips_weights"),
        (MetricWeights(), ["hpsv2"], "--hpsv2_checkpoint"),
        (MetricWeights(inception=Path("/nonexistent/inception.pth")), [], "--inception_weights"),
    ],
)
def test_weights_asked_for_but_missing_are_an_error_naming_the_flag(empty_caches, weights, required, flag):
    with pytest.raises(MetricWeightsError, match=flag):
        load_image_metrics(weights, required=required, allow_download=False)


def test_weights_are_found_in_the_usual_caches(empty_caches, weights):
    checkpoints = empty_caches / "torch_home" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copy(weights.inception, checkpoints / INCEPTION_FILE)
    shutil.copy(weights.lpips, checkpoints / ALEXNET_FILE)
    snapshot = empty_caches / "hf_hub" / "models--xswu--HPSv2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(weights.hpsv2, snapshot / HPS_FILE)
    (empty_caches / "hf_hub" / "models--xswu--HPSv2" / "refs").mkdir()
    (empty_caches / "hf_hub" / "models--xswu--HPSv2" / "refs" / "main").write_text("0123abcd")
    metrics = load_image_metrics(MetricWeights(), allow_download=False, hps_architecture=TINY_CLIP)
    assert metrics.enabled == ("fid", "kid", "is", "lpips", "hpsv2")


def test_only_wanted_metrics_are_loaded(weights):
    metrics = load_image_metrics(weights, wanted=["lpips"], allow_download=False)
    assert metrics.enabled == ("lpips",) and metrics.inception is None and metrics.hps_scorer is None


class _RunsCode:
    """A pickle that runs code when loaded without weights_only (it creates a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("network", ["inception", "lpips", "hpsv2"])
def test_weight_files_are_loaded_as_tensors_only(tmp_path, weights, network):
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": _RunsCode(marker)}, path)
    wanted = {"inception": ["fid"], "lpips": ["lpips"], "hpsv2": ["hpsv2"]}[network]
    with pytest.raises(MetricWeightsError, match="cannot load"):
        load_image_metrics(MetricWeights(**{network: path}), wanted=wanted, allow_download=False, hps_architecture=TINY_CLIP)
    assert not marker.exists()


def _register_tiny_clip_repeatedly(folder: Path, times: int) -> int:
    """How many of `times` registrations failed, in a forked process."""
    failures = 0
    for _ in range(times):
        try:
            register_tiny_clip(folder)
        except ValueError:  # json.JSONDecodeError: the config file read while another process rewrote it
            failures += 1
    return failures


@pytest.mark.multiprocess
def test_ranks_registering_the_tiny_clip_at_once_never_read_a_half_written_config(tmp_path):
    """The ranks of validation_worker.py register it together; rewriting the file in place failed a rank on an
    empty file now and then (before the fix, 43 of this test's 200 registrations failed)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        failures = pool.starmap(_register_tiny_clip_repeatedly, [(tmp_path, 100)] * 2)
    assert failures == [0, 0]
