"""Image metrics for validation: FID, KID and Inception Score on InceptionV3 features, LPIPS, HPSv2.1.

Conventions (so figures compare with published ones):
  - FID / KID / IS: torch-fidelity's InceptionV3 (the TensorFlow FID network converted to PyTorch, with
    TensorFlow-1-compatible bilinear resizing to 299 x 299), pool3 features (2048) for FID and KID, the
    1008-class logits without bias for IS, and torch-fidelity's own formulas (`fid_statistics_to_metric`,
    `kid_features_to_metric`: polynomial kernel, 100 subsets of min(1000, N) images; `isc_features_to_metric`:
    min(10, N) splits). One network forward per image gives all three. FID of sets smaller than the 2048
    features is the same quantity in an exact low-rank form (`frechet_distance`).
  - LPIPS: torchmetrics' implementation with the AlexNet backbone (its linear layers ship in the wheel),
    inputs in [-1, 1], one distance per (generated, real) pair, averaged.
  - HPSv2.1: open_clip ViT-H-14 with the official HPS_v2.1_compressed.pt weights; images resized (longest side) and padded to 224
    (bicubic) on the short side, centre-cropped, OpenAI mean/std; score = cosine similarity of the image
    and caption embeddings (as HPSv2's own scorer: no logit scale).

Weights of each network come from an explicit path (--inception_weights, --lpips_weights, --hpsv2_checkpoint),
else the usual cache ($TORCH_HOME/hub/checkpoints for Inception and AlexNet, the Hugging Face hub cache for
HPSv2), else a download where allowed. Missing weights switch their metrics off with one warning, or stop
the run when the user asked for those metrics (a path flag, or the metric named in the list of required
ones). Every file is read with torch.load(weights_only=True): tensors only, no code.
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import nn

# torchvision and torch-fidelity are imported where a metric network is built or a set is scored, so a start
# refused for its flags or caches ends without their imports (a training run gets torchvision
# through transformers anyway).

METRICS = ("fid", "kid", "is", "lpips", "hpsv2")
NEEDS_REFERENCE = ("fid", "kid", "lpips")  # compared with the held-out real images

# torch-fidelity's URL_INCEPTION_V3 and torchvision's AlexNet_Weights.IMAGENET1K_V1.url (tests/evaluation/test_metrics.py
# checks both against the installed libraries).
URL_INCEPTION_V3 = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
INCEPTION_FILE = URL_INCEPTION_V3.rsplit("/", 1)[1]  # weights-inception-2015-12-05-6726825d.pth
ALEXNET_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"
ALEXNET_FILE = ALEXNET_URL.rsplit("/", 1)[1]  # alexnet-owt-7be5be79.pth
HPS_REPO, HPS_FILE = "xswu/HPSv2", "HPS_v2.1_compressed.pt"
HPS_ARCHITECTURE = "ViT-H-14"
KID_SUBSET_SIZE = 1000  # torch-fidelity's default; smaller sets use all their images per subset
IS_SPLITS = 10
FEATURE_BATCH = 16


class MetricWeightsError(RuntimeError):
    """Weights for a metric the user asked for are missing or unreadable; the message names the flag."""


class MetricSkipped(UserWarning):
    """Weights for a metric are not available, so it is not computed this run."""


@dataclass(frozen=True)
class MetricWeights:
    """Explicit weight files (None = look in the usual cache, then download where allowed)."""

    inception: Path | None = None  # --inception_weights: weights-inception-2015-12-05-6726825d.pth
    lpips: Path | None = None  # --lpips_weights: torchvision's alexnet-owt-7be5be79.pth
    hpsv2: Path | None = None  # --hpsv2_checkpoint: HPS_v2.1_compressed.pt


@dataclass(frozen=True)
class _Network:
    attribute: str  # field of MetricWeights and of ImageMetrics
    module: str  # field of ImageMetrics holding the loaded network
    flag: str
    metrics: tuple[str, ...]
    describe: str  # what to download and where it goes, for messages


NETWORKS = (
    _Network("inception", "inception", "--inception_weights", ("fid", "kid", "is"), f"{INCEPTION_FILE} from {URL_INCEPTION_V3}, or put it in $TORCH_HOME/hub/checkpoints/"),
    _Network("lpips", "lpips_network", "--lpips_weights", ("lpips",), f"{ALEXNET_FILE} from {ALEXNET_URL}, or put it in $TORCH_HOME/hub/checkpoints/"),
    _Network("hpsv2", "hps_scorer", "--hpsv2_checkpoint", ("hpsv2",), f"{HPS_FILE} from the Hugging Face repo {HPS_REPO}, or have it in the hub cache"),
)


@contextmanager
def torch_loads_weights_only():
    """Make every torch.load inside accept tensors only. torch-fidelity reads its Inception file with
    torch.load(weights_only=False); torch's documented TORCH_FORCE_WEIGHTS_ONLY_LOAD switch overrides that."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


# ---- finding weight files ------------------------------------------------------------------------------


def torch_hub_checkpoint(file_name: str) -> Path:
    """Where torch.hub / torchvision keep a downloaded file: $TORCH_HOME/hub/checkpoints/<file_name>."""
    return Path(torch.hub.get_dir()) / "checkpoints" / file_name


def _download_to_torch_hub(url: str, file_name: str) -> Path:
    target = torch_hub_checkpoint(file_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # The file names end in the first 8 hex digits of the file's SHA-256, which torch.hub checks.
    torch.hub.download_url_to_file(url, str(target), hash_prefix=file_name.rsplit("-", 1)[1].split(".")[0])
    return target


def _hps_from_hub_cache() -> Path | None:
    import huggingface_hub

    found = huggingface_hub.try_to_load_from_cache(HPS_REPO, HPS_FILE)
    return Path(found) if isinstance(found, str) else None


def _download_hps() -> Path:
    import huggingface_hub

    return Path(huggingface_hub.hf_hub_download(HPS_REPO, HPS_FILE))


def _cached_and_download(attribute: str) -> tuple[Callable[[], Path | None], Callable[[], Path]]:
    if attribute == "inception":
        return lambda: torch_hub_checkpoint(INCEPTION_FILE), lambda: _download_to_torch_hub(URL_INCEPTION_V3, INCEPTION_FILE)
    if attribute == "lpips":
        return lambda: torch_hub_checkpoint(ALEXNET_FILE), lambda: _download_to_torch_hub(ALEXNET_URL, ALEXNET_FILE)
    return _hps_from_hub_cache, _download_hps


def resolve_weights(network: _Network, explicit: Path | None, allow_download: bool) -> tuple[Path | None, str]:
    """(path, "") when the weights are found, else (None, why not). A missing explicit path is an error."""
    if explicit is not None:
        if not explicit.is_file():
            raise MetricWeightsError(f"{network.flag} {explicit} does not exist: download {network.describe}.")
        return explicit, ""
    cached, download = _cached_and_download(network.attribute)
    path = cached()
    if path is not None and path.is_file():
        return path, ""
    if not allow_download:
        return None, f"no weights in the cache and downloads are off; pass {network.flag} (download {network.describe})"
    try:
        return download(), ""
    except Exception as error:  # network errors come as URLError, HTTPError, huggingface_hub errors, OSError...
        return None, f"download failed ({type(error).__name__}: {error}); pass {network.flag} (download {network.describe})"


# ---- building the networks -----------------------------------------------------------------------------


def load_inception(path: Path) -> nn.Module:
    """torch-fidelity's InceptionV3 giving pool3 features (2048) and unbiased logits (1008) per uint8 image."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    with torch_loads_weights_only():
        return FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(path))


def load_lpips(path: Path) -> nn.Module:
    """torchmetrics' LPIPS network (AlexNet) with the backbone read from `path`.

    torchmetrics' public LPIPS metric fetches the backbone through torchvision itself and takes no file, so
    the module behind it is built with a random backbone and the file's weights are copied in; the LPIPS
    linear layers are the ones shipped inside torchmetrics."""
    import torchvision
    from torchmetrics.functional.image.lpips import _NoTrainLpips

    with torch_loads_weights_only():
        network = _NoTrainLpips(net="alex", pretrained=True, pnet_rand=True)
        alexnet = torchvision.models.alexnet()
        alexnet.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    # torchmetrics' Alexnet keeps torchvision's `features` layers under their original indices, in 5 slices.
    for piece in (network.net.slice1, network.net.slice2, network.net.slice3, network.net.slice4, network.net.slice5):
        for name, layer in piece.named_children():
            layer.load_state_dict(alexnet.features[int(name)].state_dict())
    return network.eval()


class HPSScorer(nn.Module):
    """HPSv2.1: cosine similarity of an open_clip model's image and text embeddings."""

    def __init__(self, model: nn.Module, tokenizer: Callable[[list[str]], torch.Tensor], mean_std: tuple[tuple[float, ...], tuple[float, ...]]):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.mean_std = mean_std
        size = model.visual.image_size
        self.image_size = size[0] if isinstance(size, (tuple, list)) else int(size)

    def preprocess(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W) -> normalised (3, S, S) exactly as HPSv2's validation transform (its open_clip's
        ResizeMaxSize): the longest side resized to S (PIL bicubic), the rest padded with black, centred, so
        the whole image is scored whatever its bucket's aspect ratio (a centre crop would cut a wide image)."""
        import torchvision.transforms.functional as TF

        pil = Image.fromarray(image.permute(1, 2, 0).cpu().numpy())
        size = self.image_size
        scale = size / max(pil.width, pil.height)
        if scale != 1.0:
            height, width = round(pil.height * scale), round(pil.width * scale)
            pil = TF.resize(pil, [height, width], interpolation=TF.InterpolationMode.BICUBIC)
            pad_height, pad_width = size - height, size - width
            pil = TF.pad(pil, [pad_width // 2, pad_height // 2, pad_width - pad_width // 2, pad_height - pad_height // 2], fill=0)
        return TF.normalize(TF.to_tensor(pil), *self.mean_std)

    @torch.no_grad()
    def forward(self, images: list[torch.Tensor], captions: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        pixels = torch.stack([self.preprocess(image) for image in images]).to(device)
        tokens = self.tokenizer(captions).to(device)
        # HPSv2 scores under autocast (fp16) on GPUs; fp32 elsewhere.
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            image_embeds = self.model.encode_image(pixels, normalize=True)
            text_embeds = self.model.encode_text(tokens, normalize=True)
        return (image_embeds.float() * text_embeds.float()).sum(dim=-1)


def load_hps(path: Path, architecture: str = HPS_ARCHITECTURE) -> HPSScorer:
    """open_clip's `architecture` with the HPS checkpoint loaded by open_clip itself: a strict load, tensors
    only (weights_only=True), with its conversions for checkpoints of older open_clip versions (HPSv2's)."""
    import open_clip  # with timm and wandb, a large share of the trainer's import time: only where HPSv2 is scored

    model = open_clip.create_model(architecture, pretrained=str(path), weights_only=True)
    return HPSScorer(model, open_clip.get_tokenizer(architecture), (open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD))


# ---- scoring -------------------------------------------------------------------------------------------


def _batches_by_size(images: list[torch.Tensor], batch: int = FEATURE_BATCH) -> list[list[int]]:
    """Indices of images grouped by (height, width), in chunks: images of one size run as one batch."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, image in enumerate(images):
        groups[tuple(image.shape[1:])].append(index)
    return [indices[start : start + batch] for indices in groups.values() for start in range(0, len(indices), batch)]


@dataclass
class ImageMetrics:
    """The metric networks of a run (loaded once) and the scoring of image sets.

    Per image (can run on any rank, for its own images): `inception_features`, `lpips`, `hps`.
    Per set (on the gathered per-image values): `summarize`. `score` does both for one process."""

    inception: nn.Module | None = None
    lpips_network: nn.Module | None = None
    hps_scorer: HPSScorer | None = None
    wanted: tuple[str, ...] = METRICS
    skipped: dict[str, str] = field(default_factory=dict)  # metric -> why it is off

    @property
    def enabled(self) -> tuple[str, ...]:
        """The wanted metrics whose network is loaded."""
        loaded = {name for network in NETWORKS if getattr(self, network.module) is not None for name in network.metrics}
        return tuple(name for name in self.wanted if name in loaded)

    def to(self, device: torch.device) -> ImageMetrics:
        for network in (self.inception, self.lpips_network, self.hps_scorer):
            if network is not None:
                network.to(device)
        return self

    def _device(self) -> torch.device:
        network = next(net for net in (self.inception, self.lpips_network, self.hps_scorer) if net is not None)
        return next(network.parameters()).device

    @torch.no_grad()
    def inception_features(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (3, H, W) images -> (pool3 features (N, 2048), unbiased logits (N, 1008)), float64 on the CPU."""
        pool = torch.zeros(len(images), 2048, dtype=torch.float64)
        logits = torch.zeros(len(images), 1008, dtype=torch.float64)
        for indices in _batches_by_size(images):
            batch = torch.stack([images[i] for i in indices]).to(self._device())
            features, unbiased = self.inception(batch)
            pool[indices], logits[indices] = features.double().cpu(), unbiased.double().cpu()
        return pool, logits

    @torch.no_grad()
    def lpips(self, generated: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
        """LPIPS distance of each generated image to its reference image (same size), float64 (N,)."""
        distances = torch.zeros(len(generated), dtype=torch.float64)
        for indices in _batches_by_size(generated):
            fake = torch.stack([generated[i] for i in indices]).to(self._device()).float() / 127.5 - 1
            real = torch.stack([reference[i] for i in indices]).to(self._device()).float() / 127.5 - 1
            distances[indices] = self.lpips_network(fake, real).reshape(-1).double().cpu()
        return distances

    @torch.no_grad()
    def hps(self, images: list[torch.Tensor], captions: list[str]) -> torch.Tensor:
        """HPSv2.1 score of each image with its caption, float64 (N,)."""
        scores = torch.zeros(len(images), dtype=torch.float64)
        for start in range(0, len(images), FEATURE_BATCH):
            chunk = slice(start, start + FEATURE_BATCH)
            scores[chunk] = self.hps_scorer(images[chunk], captions[chunk]).double().cpu()
        return scores

    def summarize(
        self,
        real_pool: torch.Tensor | None,
        fake_pool: torch.Tensor | None,
        fake_logits: torch.Tensor | None,
        lpips: torch.Tensor | None,
        hps: torch.Tensor | None,
    ) -> dict[str, float]:
        """Set-level scores named like their TensorBoard tags; a metric is left out when it is off or its
        inputs are too few (FID and KID need 2 images on each side)."""
        from torch_fidelity.metric_isc import isc_features_to_metric
        from torch_fidelity.metric_kid import kid_features_to_metric

        scores = {}
        enabled = self.enabled
        comparable = real_pool is not None and fake_pool is not None and min(len(real_pool), len(fake_pool)) >= 2
        if "fid" in enabled and comparable:
            scores["val/fid"] = frechet_distance(real_pool, fake_pool)
        if "kid" in enabled and comparable:
            subset = min(KID_SUBSET_SIZE, len(real_pool), len(fake_pool))
            scores["val/kid"] = kid_features_to_metric(real_pool, fake_pool, kid_subset_size=subset, verbose=False)["kernel_inception_distance_mean"]
        if "is" in enabled and fake_logits is not None and len(fake_logits):
            scores["val/is"] = isc_features_to_metric(fake_logits, splits=min(IS_SPLITS, len(fake_logits)))["inception_score_mean"]
        if "lpips" in enabled and lpips is not None and len(lpips):
            scores["val/lpips"] = float(lpips.mean())
        if "hpsv2" in enabled and hps is not None and len(hps):
            scores["val/hpsv2"] = float(hps.mean())
        return scores

    def score(self, generated: list[torch.Tensor], reference: list[torch.Tensor] | None, captions: list[str]) -> dict[str, float]:
        """Every enabled metric of one set of uint8 images (reference[i] is the real image of generated[i])."""
        real_pool = fake_pool = fake_logits = lpips = hps = None
        if self.inception is not None:
            fake_pool, fake_logits = self.inception_features(generated)
            if reference is not None:
                real_pool, _ = self.inception_features(reference)
        if self.lpips_network is not None and reference is not None:
            lpips = self.lpips(generated, reference)
        if self.hps_scorer is not None:
            hps = self.hps(generated, captions)
        return self.summarize(real_pool, fake_pool, fake_logits, lpips, hps)


def frechet_distance(real: torch.Tensor, fake: torch.Tensor) -> float:
    """FID of two feature sets (one row per image): |mu1 - mu2|^2 + tr S1 + tr S2 - 2 tr sqrt(S1 S2).

    torch-fidelity takes tr sqrt(S1 S2) from the eigenvalues of the 2048 x 2048 product, seconds on one CPU
    thread at every validation (docs/validation.md, "Cost"). A set of n images has a covariance S = A^T A of rank below n (A: its centred
    features over sqrt(n - 1)), and then tr sqrt(S1 S2) is exactly the sum of the singular values of A1 A2^T,
    an n1 x n2 matrix: the same FID in milliseconds for validation sets smaller than the feature width.
    Larger sets go through torch-fidelity's own formula."""
    if min(len(real), len(fake)) >= real.shape[1]:
        from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric

        statistics = [fid_features_to_statistics(features) for features in (real, fake)]
        return fid_statistics_to_metric(*statistics, verbose=False)["frechet_inception_distance"]
    real, fake = real.double(), fake.double()
    centred = [(features - features.mean(0)) / (len(features) - 1) ** 0.5 for features in (real, fake)]
    mean_difference = real.mean(0) - fake.mean(0)
    root_trace = torch.linalg.svdvals(centred[0] @ centred[1].T).sum()
    return float(mean_difference @ mean_difference + (centred[0] ** 2).sum() + (centred[1] ** 2).sum() - 2 * root_trace)


def load_image_metrics(
    weights: MetricWeights,
    wanted: Iterable[str] = METRICS,
    required: Iterable[str] = (),
    allow_download: bool = True,
    warn: bool = True,
    hps_architecture: str = HPS_ARCHITECTURE,
) -> ImageMetrics:
    """Load the networks of the `wanted` metrics, once per run, into CPU memory.

    A network whose weights cannot be found switches its metrics off (one MetricSkipped warning when
    `warn`, e.g. on rank 0 only; the reason is in `.skipped`), unless one of its metrics is in `required`
    or its path flag was given: then MetricWeightsError, naming the flag."""
    wanted, required = set(wanted), set(required)
    unknown = (wanted | required) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {METRICS}")
    loaders = {"inception": load_inception, "lpips": load_lpips, "hpsv2": lambda path: load_hps(path, hps_architecture)}
    metrics = ImageMetrics(wanted=tuple(name for name in METRICS if name in wanted | required))
    for network in NETWORKS:
        names = [name for name in network.metrics if name in wanted | required]
        if not names:
            continue
        path, reason = resolve_weights(network, getattr(weights, network.attribute), allow_download)
        if path is None:
            if required & set(names):
                raise MetricWeightsError(f"validation metrics {sorted(required & set(names))} need weights: {reason}.")
            metrics.skipped.update({name: reason for name in names})
            if warn:
                warnings.warn(f"validation metrics {names} are off: {reason}.", MetricSkipped, stacklevel=2)
            continue
        try:
            network_module = loaders[network.attribute](path)
        except Exception as error:  # a damaged or foreign file: never silently skip what was found
            raise MetricWeightsError(f"cannot load {path} for {names} ({type(error).__name__}: {error}); check {network.flag}.") from error
        setattr(metrics, network.module, network_module)
    return metrics
