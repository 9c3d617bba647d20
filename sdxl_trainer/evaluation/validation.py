"""Validation on the held-out items: the denoising loss at fixed noise and timesteps, and image metrics of
images generated for the held-out captions.

Validation loss. Every held-out item gets one fixed noise and one fixed timestep, drawn from the
item's own generator (diffusion.sample_seed with a validation key in place of the epoch), so between two
validations only the model changes. Timesteps are stratified: the items, in a fixed order, take the
ranges [0, 333), [333, 667), [667, 1000) in turn, so every range gets a third of them and its own mean
(`val/loss_t0-333` is the low-noise end: fine detail; `val/loss_t667-1000` the high-noise end: layout and
colour). No caption dropout, no noise offset, no Min-SNR weighting, no timestep bias or logit-normal
sampling: plain MSE against the model's target whatever --loss_type trains with, so val/loss is the same
number whatever the training options and runs that differ in them can be compared. Batches (one bucket and one range each) are spread over the
ranks; ranks with fewer batches repeat one with weight 0, since with FSDP every forward is a collective.
The per-range sums and counts are added up in one all_reduce.

Validation images. Each held-out item's image is generated from its cached caption embeddings (its first
caption through the trained encoders, with --train_text_encoder) at its bucket size with a fixed seed,
each rank generating its own share (see sampling.py). Each rank scores its own images (Inception
features, LPIPS against the item's real image, HPSv2 with its caption), and only the per-image numbers
travel to rank 0, which computes the set scores (FID, KID, IS need the whole set). The real images, and
their Inception features, are prepared once per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.distributed as dist

from sdxl_trainer.cache.buckets import Bucket, crop_into
from sdxl_trainer.cache.format import LOSS_MASK_KEY, sha256_bytes
from sdxl_trainer.distributed.fsdp import reshard_units
from sdxl_trainer.evaluation.metrics import NEEDS_REFERENCE, ImageMetrics
from sdxl_trainer.evaluation.sampling import GenerationSettings, ImageRequest, decode_latents, gather_rows, generate, rank_share
from sdxl_trainer.models.encoders import CaptionEmbeddings
from sdxl_trainer.preparation.images import UnreadableImage, decode_image, resize_and_crop
from sdxl_trainer.training.dataset import CachedDataset, collate
from sdxl_trainer.training.loss import training_loss
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import sample_seed

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

# Stand-ins for the epoch in sample_seed(seed, key, item): training epochs never reach these.
VALIDATION_LOSS_KEY = 1_000_001
VALIDATION_IMAGE_KEY = 1_000_002
TIMESTEP_RANGES = ((0, 333), (333, 667), (667, 1000))

CaptionEncoding = Callable[[list[str]], CaptionEmbeddings]  # captions -> embeddings by a pipeline's (trained) text encoders


def range_tag(low: int, high: int) -> str:
    return f"val/loss_t{low}-{high}"


def loss_batches(items: np.ndarray, bucket_ids: np.ndarray, batch_size: int, ranges=TIMESTEP_RANGES) -> list[tuple[int, np.ndarray]]:
    """(range index, items) batches: item k of the sorted items takes range k mod len(ranges); a batch holds
    items of one bucket and one range. The same on every rank and for every number of ranks."""
    items = np.sort(np.asarray(items, dtype=np.int64))
    range_of = np.arange(len(items)) % len(ranges)
    batches = []
    for range_index in range(len(ranges)):
        in_range = items[range_of == range_index]
        for bucket in np.unique(bucket_ids[in_range]):
            members = in_range[bucket_ids[in_range] == bucket]
            batches.extend((range_index, members[start : start + batch_size]) for start in range(0, len(members), batch_size))
    return batches


@torch.no_grad()
def validation_loss(
    unet: torch.nn.Module,
    dataset: CachedDataset,
    items: np.ndarray,
    noise_scheduler: DDPMScheduler,
    seed: int,
    device: torch.device,
    batch_size: int = 4,
    ranges=TIMESTEP_RANGES,
    encode_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Mean validation loss over `items`, overall ("val/loss") and per timestep range ("val/loss_t0-333", ...),
    on every rank. Every rank must call this with the same arguments (the UNet may be FSDP-sharded).
    Ranges without items are left out. `encode_batch` replaces a batch's cached caption embeddings (trained
    text encoders: StepCaptionEncoder.first_captions)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = loss_batches(items, dataset.bucket_ids(), batch_size, ranges)
    mine = rank_share(batches, rank, world_size)
    calls = -(-len(batches) // world_size)  # the busiest rank's number of batches
    sums = torch.zeros(len(ranges), 2, dtype=torch.float64, device=device)  # per range: loss sum, item count
    was_training = unet.training
    unet.eval()
    for call in range(calls):
        range_index, batch_items = mine[call] if call < len(mine) else batches[0]
        # Unmasked, as it is unweighted: one measure that runs with other loss options compare on.
        batch = {key: value.to(device) for key, value in collate([dataset[int(i)] for i in batch_items]).items() if key != LOSS_MASK_KEY}
        if encode_batch is not None:
            batch = encode_batch(batch)
        low, high = ranges[range_index]
        # No dropout: the caption is always used, so the "empty prompt" argument is never selected.
        settings = NoiseSettings(conditional_dropout_percent=0.0, min_timestep=low, max_timestep=high)
        empty = (batch["prompt_embeds"][0], batch["pooled_prompt_embeds"][0])
        loss = training_loss(unet, batch, noise_scheduler, empty, seed, VALIDATION_LOSS_KEY, settings)
        if call < len(mine):  # padding batches only keep the collectives in step
            sums[range_index, 0] += loss.double() * len(batch_items)
            sums[range_index, 1] += len(batch_items)
    reshard_units(unet)  # no backward followed these forwards to reshard what stays gathered after one
    unet.train(was_training)
    if dist.is_initialized() and world_size > 1:
        dist.all_reduce(sums)
    sums = sums.cpu()
    results = {"val/loss": float(sums[:, 0].sum() / sums[:, 1].sum())} if sums[:, 1].sum() > 0 else {}
    for (low, high), (total, count) in zip(ranges, sums.tolist()):
        if count:
            results[range_tag(low, high)] = total / count
    return results


# ---- real images of held-out items -------------------------------------------------------------------


def source_image(dataset: CachedDataset, item: int, data_dirs: list[Path]) -> torch.Tensor | None:
    """The item's source image cropped exactly as it was cached, uint8 (3, H, W); None when the file is
    missing, changed since caching (content hash), or was upscaled (the upscaler's output is not kept)."""
    original_h, original_w, crop_top, crop_left, bucket_h, bucket_w = (int(v) for v in dataset.time_ids[item])
    if bucket_w > original_w or bucket_h > original_h:  # only upscaled images are smaller than their bucket
        return None
    path = data_dirs[int(dataset.cache_index[item])] / dataset.image_paths[item]
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if sha256_bytes(data) != dataset.image_sha256[item]:
        return None
    try:
        image = decode_image(data)
    except UnreadableImage:
        return None
    plan = crop_into(original_w, original_h, Bucket(bucket_w, bucket_h), category=0)
    if image.size != (original_w, original_h) or (plan.crop_top, plan.crop_left) != (crop_top, crop_left):
        return None
    return torch.from_numpy(np.array(resize_and_crop(image, plan))).permute(2, 0, 1).contiguous()


def decoded_latents(dataset: CachedDataset, item: int, vae) -> torch.Tensor:
    """The item's cached latents decoded by the VAE, uint8 (3, H, W): the best stand-in for a missing source."""
    return decode_latents(vae, dataset[item]["latents"][None])[0].cpu()


def reference_images(dataset: CachedDataset, items: list[int], data_dirs: list[Path] | None, vae) -> tuple[list[torch.Tensor], int]:
    """Real images of `items` (source images when `data_dirs` is given and they match the cache, else the
    decoded latents) and how many had to be decoded."""
    images, decoded = [], 0
    for item in items:
        image = source_image(dataset, item, data_dirs) if data_dirs is not None else None
        if image is None:
            image = decoded_latents(dataset, item, vae)
            decoded += 1
        images.append(image)
    return images, decoded


# ---- image validation --------------------------------------------------------------------------------


@dataclass
class _References:
    images: list[torch.Tensor]  # this rank's share, in order
    pool: torch.Tensor | None  # on rank 0: Inception features of all real images
    decoded: int  # over all ranks: real images that came from decoded latents


class ImageValidator:
    """Generates the held-out items' images with the given pipeline's UNet and scores them.

    Build once per run (it keeps the real images and their features); call at each validation."""

    def __init__(
        self,
        dataset: CachedDataset,
        items: np.ndarray,
        metrics: ImageMetrics,
        seed: int,
        device: torch.device,
        settings: GenerationSettings = GenerationSettings(),
        data_dirs: list[Path] | None = None,
    ):
        self.dataset = dataset
        self.items = [int(item) for item in np.sort(items)]
        self.metrics = metrics
        self.seed = seed
        self.device = device
        self.settings = settings
        self.data_dirs = data_dirs
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.my_items = rank_share(self.items, self.rank, self.world_size)
        self._references: _References | None = None

    def requests(self, encode_captions: CaptionEncoding | None = None) -> list[ImageRequest]:
        """This rank's generation requests: caption embeddings (cached, or the items' first captions through
        `encode_captions` where the text encoders were trained), bucket size, the item's fixed seed."""
        encoded = encode_captions([self.dataset.caption(item) for item in self.my_items]) if encode_captions and self.my_items else None
        requests = []
        for position, item in enumerate(self.my_items):
            if encoded is None:
                tensors = self.dataset[item]
                embeds, pooled = tensors["prompt_embeds"].float(), tensors["pooled_prompt_embeds"].float()
            else:
                embeds, pooled = encoded.prompt_embeds[position].cpu(), encoded.pooled_prompt_embeds[position].cpu()
            width, height = self.dataset.bucket_size(item)
            seed = sample_seed(self.seed, VALIDATION_IMAGE_KEY, item)
            requests.append(ImageRequest(item, embeds, pooled, width, height, seed))
        return requests

    def _prepare_references(self, vae) -> _References:
        images, decoded = reference_images(self.dataset, self.my_items, self.data_dirs, vae)
        pool = None
        if self.metrics.inception is not None:
            local_pool, _ = self.metrics.inception_features(images)
            pool = gather_rows(local_pool, self.device)
        counts = torch.tensor([decoded], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(counts)
        return _References(images, pool, int(counts.item()))

    @property
    def decoded_reference_count(self) -> int | None:
        """How many real images are decoded latents instead of source images (known after the first call)."""
        return None if self._references is None else self._references.decoded

    def generate(self, pipeline: StableDiffusionXLPipeline, negative: tuple[torch.Tensor, torch.Tensor],
                 encode_captions: CaptionEncoding | None = None) -> dict[int, torch.Tensor]:
        """This rank's validation images {item: uint8 (3, H, W)}. Every rank must call this."""
        return generate(pipeline, self.requests(encode_captions), self.settings, negative, self.device)

    def __call__(self, pipeline: StableDiffusionXLPipeline, negative: tuple[torch.Tensor, torch.Tensor],
                 encode_captions: CaptionEncoding | None = None) -> dict[str, float]:
        """Generate and score; rank 0 gets {"val/fid": ..., "val/kid": ..., "val/is": ..., "val/lpips": ...,
        "val/hpsv2": ...} (the enabled metrics), other ranks {}. Every rank must call this."""
        generated = self.generate(pipeline, negative, encode_captions)
        self.metrics.to(self.device)
        if self._references is None and set(self.metrics.enabled) & set(NEEDS_REFERENCE):
            self._references = self._prepare_references(pipeline.vae)
        per_image = self._per_image_scores([generated[item] for item in self.my_items])
        self.metrics.to(torch.device("cpu"))  # the metric networks only hold device memory while scoring
        if not per_image:
            return {}
        rows = gather_rows(torch.cat(list(per_image.values()), dim=1), self.device)  # the only transfer: numbers
        if rows is None:
            return {}
        parts = dict(zip(per_image, rows.split([column.shape[1] for column in per_image.values()], dim=1)))
        real_pool = self._references.pool if self._references is not None else None
        lpips, hps = (parts[name][:, 0] if name in parts else None for name in ("lpips", "hps"))
        return self.metrics.summarize(real_pool, parts.get("pool"), parts.get("logits"), lpips, hps)

    def _per_image_scores(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's per-image numbers, float64 (n, width) each: Inception pool features and logits, LPIPS
        against the real image, HPS with the caption (those whose network is loaded)."""
        scores = {}
        if self.metrics.inception is not None:
            scores["pool"], scores["logits"] = self.metrics.inception_features(images)
        if self.metrics.lpips_network is not None:
            scores["lpips"] = self.metrics.lpips(images, self._references.images)[:, None]
        if self.metrics.hps_scorer is not None:
            scores["hps"] = self.metrics.hps(images, [self.dataset.caption(item) for item in self.my_items])[:, None]
        return scores
