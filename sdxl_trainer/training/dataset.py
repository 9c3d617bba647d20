"""The dataset of cached items from one or more caches: each sample's tensors, micro-conditioning, loss
weight and (with --flip_aug) the view drawn for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from sdxl_trainer.cache.format import FLIPPED_KEY, LOSS_MASK_KEY, TENSOR_KEYS, CacheLocation, captions_in, read_cache_info
from sdxl_trainer.cache.reader import CacheReader, intact_parts, merge_parts
from sdxl_trainer.config import option

FLIP_STREAM = 13  # seed-sequence entry of the --flip_aug draws, apart from the noise and caption draws

@dataclass(kw_only=True)
class DatasetOptions:
    """One cache a run trains on: a [[datasets]] table of a TOML --config. The --cached_dataset_dirs and --dataset_*
    flags are the command line's shorthand for the same records (DataOptions.dataset_records)."""

    cache_dir: str = option(help="a cache written by sdxl_process_data_dir.py: a folder, or s3://bucket/prefix in S3-compatible object storage")
    repeats: float = option(
        1.0, help="times its items are trained per epoch: 3 = three copies, each with its own noise and caption draws; 0.5 = a seeded half "
        "of the items, another half every epoch (--dataset_repeats)",
    )
    loss_weight: float = option(
        1.0, help="its samples' training loss is multiplied by this before the batch mean, so 0.5 halves its pull on the weights (kohya's "
        "prior_loss_weight, OneTrainer's concept loss_weight; --dataset_loss_weights); the validation loss stays unweighted",
    )
    shuffle_caption: bool | None = option(None, help="caption mode: --shuffle_caption for this cache's captions; None = the run-wide flag")
    keep_tokens: int | None = option(None, help="caption mode: --keep_tokens for this cache's captions; None = the run-wide flag")
    caption_tag_dropout_rate: float | None = option(None, help="caption mode: --caption_tag_dropout_rate for this cache; None = the run-wide flag")
    validation_source_dir: Path | None = option(
        None, help="the image folder the cache was made from: real images for FID/LPIPS (give one for every cache or for none); None = decoded cached latents"
    )


class CachedDataset(Dataset):
    """All items of the given caches. Item i's tensors are read from its shard on access. With
    `loss_weights` (one per cache, --dataset_loss_weights) each item also carries its cache's "loss_weight"; with
    `flip_aug` (caches made with --flip_aug) its mirrored view too, for choose_views; with `loss_masks`
    (--masked_loss) its "loss_mask" at latent size: the cached one, or ones (trained everywhere) for an item without."""

    def __init__(self, cache_dirs: list[CacheLocation], loss_weights: list[float] | None = None, flip_aug: bool = False, loss_masks: bool = False):
        self.flip_aug = flip_aug
        self.loss_masks = loss_masks
        self.cache_dirs = list(cache_dirs)
        self.loss_weights = None if loss_weights is None else [float(weight) for weight in loss_weights]
        self.cache_settings = [read_cache_info(cache_dir) for cache_dir in self.cache_dirs]  # each cache's caption prefix and suffix
        tables = []
        self._shard_bytes = []  # per cache: shard name -> size, so the readers need not read the manifest again
        for cache_index, cache_dir in enumerate(self.cache_dirs):
            parts = intact_parts(cache_dir)
            self._shard_bytes.append({part.shard: part.shard_bytes for part, _ in parts})
            table = merge_parts(parts)
            tables.append(table.append_column("cache_index", pa.array(np.full(len(table), cache_index, dtype=np.int32))))
        table = pa.concat_tables(tables) if tables else pa.table({})
        self.num_items = len(table)

        def column(name: str) -> np.ndarray:
            return table.column(name).to_numpy()

        self.cache_index = column("cache_index")
        self.shard = table.column("shard").to_pylist()
        self.index_in_shard = column("index_in_shard")
        self.caption_texts = table.column("caption").to_pylist()  # one caption per line (cache.captions_in)
        self.image_paths = table.column("image_path").to_pylist()  # relative to the data folder the cache was made from
        self.image_sha256 = table.column("image_sha256").to_pylist()  # of the source image's bytes
        self.bucket_sizes = np.stack([column("bucket_width"), column("bucket_height")], axis=1)
        # SDXL add_time_ids: original (h, w), crop (top, left), target (h, w).
        self.time_ids = np.stack(
            [column(name) for name in ("original_height", "original_width", "crop_top", "crop_left", "bucket_height", "bucket_width")],
            axis=1,
        ).astype(np.float32)
        self.has_loss_mask = pc.fill_null(table.column("has_loss_mask"), False).to_numpy(zero_copy_only=False)
        if flip_aug:
            self.crop_left_flipped = pc.coalesce(table.column("crop_left_flipped"), table.column("crop_left")).to_numpy().astype(np.float32)
        self._readers: dict[int, CacheReader] = {}

    def __len__(self) -> int:
        return self.num_items

    def caption(self, index: int) -> str:
        """Item `index`'s first caption with its cache's prefix and suffix: what its cached embeddings encode."""
        return self.framed(index, captions_in(self.caption_texts[index])[0])

    def framed(self, index: int, caption: str) -> str:
        """`caption` (one of item `index`'s, as written or varied) with the item's cache's prefix and suffix."""
        return self.cache_settings[int(self.cache_index[index])].framed(caption)

    def bucket_ids(self) -> np.ndarray:
        """One integer per item naming its bucket (equal sizes = equal id)."""
        return self.bucket_sizes[:, 0].astype(np.int64) * 100_000 + self.bucket_sizes[:, 1]

    def _reader(self, cache_index: int) -> CacheReader:
        # Opened lazily, so each DataLoader worker process gets its own file handles.
        if cache_index not in self._readers:
            self._readers[cache_index] = CacheReader(self.cache_dirs[cache_index], shard_bytes=self._shard_bytes[cache_index])
        return self._readers[cache_index]

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        """Sample `sample` of a plan: the tensors of item sample % len(self), and the sample index itself."""
        return self.__getitems__([sample])[0]

    def __getitems__(self, samples: list[int]) -> list[dict[str, torch.Tensor]]:
        """A batch's samples (the DataLoader asks for a batch at once): from object storage, every item of a cache
        is requested concurrently."""
        keys = (*TENSOR_KEYS, FLIPPED_KEY) if self.flip_aug else TENSOR_KEYS
        indices = [sample % self.num_items for sample in samples]
        requests: dict[int, list[int]] = {}  # cache -> positions in the batch
        for position, index in enumerate(indices):
            requests.setdefault(int(self.cache_index[index]), []).append(position)
        tensors: list[dict[str, torch.Tensor]] = [{} for _ in samples]
        for cache_index, positions in requests.items():
            wanted = [(self.shard[indices[position]], int(self.index_in_shard[indices[position]]),
                       (*keys, LOSS_MASK_KEY) if self.loss_masks and self.has_loss_mask[indices[position]] else keys) for position in positions]
            for position, found in zip(positions, self._reader(cache_index).read_many(wanted)):
                tensors[position] = found
        return [self._with_conditioning(sample, index, found) for sample, index, found in zip(samples, indices, tensors)]

    def _with_conditioning(self, sample: int, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cached_mask = self.loss_masks and bool(self.has_loss_mask[index])
        if self.loss_masks and not cached_mask:
            tensors[LOSS_MASK_KEY] = torch.ones(1, *tensors["latents"].shape[1:], dtype=tensors["latents"].dtype)
        tensors["time_ids"] = torch.from_numpy(self.time_ids[index])
        if self.flip_aug:
            mirrored = self.time_ids[index].copy()
            mirrored[3] = self.crop_left_flipped[index]  # add_time_ids' crop left (see choose_views)
            tensors["time_ids_flipped"] = torch.from_numpy(mirrored)
        tensors["sample_index"] = torch.tensor(sample, dtype=torch.int64)
        if self.loss_weights is not None:
            tensors["loss_weight"] = torch.tensor(self.loss_weights[int(self.cache_index[index])], dtype=torch.float32)
        return tensors


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def flip_draws(run_seed: int, epoch: int, sample_indices: list[int]) -> np.ndarray:
    """Whether each sample trains mirrored this epoch: a fair coin from the sample's own generator (a stream
    apart from its noise and caption draws, so turning --flip_aug on moves none of those)."""
    return np.array(
        [np.random.Generator(np.random.PCG64(np.random.SeedSequence([run_seed, epoch, sample, FLIP_STREAM]))).random() < 0.5 for sample in sample_indices],
        dtype=bool,
    )


def choose_views(batch: dict[str, torch.Tensor], run_seed: int, epoch: int) -> dict[str, torch.Tensor]:
    """--flip_aug: each sample's latents and micro-conditioning, or with probability 1/2 (flip_draws) its mirror's.

    SDXL conditions on the crop's top-left offset in the resized image. Mirroring the crop mirrors the resized
    image too, so the mirrored crop starts at resized width - bucket width - crop left from the left edge (the
    cache records it: a centre crop's two offsets differ by the parity of the excess width); top, original and
    target sizes stay. kohya's flip_aug does the same (its width - crop right). A batch without mirrored views
    passes unchanged. A mirrored sample's loss mask is mirrored too (the mask of the mirrored crop: bucket widths are
    multiples of 8, so each latent pixel's block mirrors onto a block)."""
    if FLIPPED_KEY not in batch:
        return batch
    flipped = torch.from_numpy(flip_draws(run_seed, epoch, batch["sample_index"].tolist())).to(batch["latents"].device)
    chosen = {key: value for key, value in batch.items() if key not in (FLIPPED_KEY, "time_ids_flipped")}
    chosen["latents"] = torch.where(flipped[:, None, None, None], batch[FLIPPED_KEY], batch["latents"])
    chosen["time_ids"] = torch.where(flipped[:, None], batch["time_ids_flipped"], batch["time_ids"])
    if LOSS_MASK_KEY in batch:
        chosen[LOSS_MASK_KEY] = torch.where(flipped[:, None, None, None], batch[LOSS_MASK_KEY].flip(-1), batch[LOSS_MASK_KEY])
    return chosen
