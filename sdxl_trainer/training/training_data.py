"""A run's data opened: the caches read, the validation items held out, and the epochs planned over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from sdxl_trainer.cache.format import LOG_DIR
from sdxl_trainer.cache.stores import open_store
from sdxl_trainer.runtime.memory import release_freed_memory
from sdxl_trainer.training.data_options import DataSettings
from sdxl_trainer.training.dataset import CachedDataset
from sdxl_trainer.state.trainer_state import DatasetIdentity
from sdxl_trainer.training.epochs import EpochPlanner, bucket_counts, small_buckets, too_many_epochs, too_many_samples
from sdxl_trainer.training.holdout import HOLDOUT_FILE, Holdout, HoldoutError, dataset_item_keys, load_or_choose_holdout
from sdxl_trainer.training.stream import DataPosition, DataStream


@dataclass(frozen=True)
class TrainingData:
    """A run's data: the dataset, its held-out items (never trained on) and the epoch planner over the rest."""

    settings: DataSettings
    dataset: CachedDataset
    holdout: Holdout
    planner: EpochPlanner
    global_batch_size: int
    identity: DatasetIdentity  # the items and their order, which a checkpoint records (a resume on other data is refused)

    def stream(self, position: DataPosition, first_update: int, rank: int, device: torch.device,
               draws: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]] | None = None) -> DataStream:
        """The run's remaining updates from `position` (update `first_update` of the run), each batch with its `draws`."""
        settings = self.settings
        updates_left = max(settings.max_updates - first_update, 0) if settings.max_updates else None
        return DataStream(self.dataset, self.planner, position, settings.num_epochs, rank, settings.per_rank_batch, settings.num_workers, device,
                          updates_left, draws)


def load_training_data(settings: DataSettings, run_dir: Path, seed: int, world_size: int, is_main: bool) -> TrainingData:
    """Open the caches, hold out the validation items (chosen once per run, the same on every rank, saved in
    the run folder) and plan epochs over the rest. Refuses before the model loads a run in which no bucket holds
    one global batch (the planner would plan no batch: a resume with more processes or a larger
    --train_batch_size than the run that saved it gets here too), or whose epochs or run length are more than a
    plan holds (epochs.MAX_EPOCH_SAMPLES, MAX_EPOCHS), and warns about items that will not train."""
    dataset = CachedDataset(settings.cache_dirs, settings.loss_weights, flip_aug=settings.flip_aug, loss_masks=settings.loss_masks,
                            captions_in_memory=settings.captions_in_memory)
    items_per_cache = np.bincount(np.asarray(dataset.cache_index, dtype=np.int64), minlength=len(settings.cache_dirs))
    for cache_dir, items in zip(settings.cache_dirs, items_per_cache):
        if items == 0:  # its caching skipped every image, or has not run yet
            store = open_store(cache_dir)
            raise SystemExit(
                f"Cannot start training: cache {cache_dir} holds no items. Fill it with python sdxl_process_data_dir.py --data_dir YOUR_IMAGES "
                f"--cache_dir {cache_dir} (the flags it was made with); if that ran, {store.location(LOG_DIR)} names each image it skipped and why"
            )
    too_many = too_many_samples(items_per_cache, settings.repeats)
    if too_many:
        raise SystemExit(f"Cannot start training: {too_many}")
    global_batch_size = settings.per_rank_batch * world_size
    bucket_ids = dataset.bucket_ids()
    keys = dataset_item_keys(dataset)
    try:
        holdout = load_or_choose_holdout(run_dir / HOLDOUT_FILE, keys, bucket_ids, settings.split, seed, write=is_main)
    except HoldoutError as error:
        raise SystemExit(f"Cannot start training: {error}") from error
    identity = DatasetIdentity(len(keys), keys.fingerprint(), keys.fingerprint(in_place=True))
    repeats = np.asarray(settings.repeats)[dataset.cache_index] if settings.repeats else None
    planner = EpochPlanner(bucket_ids, holdout.trainable(len(dataset)), global_batch_size, settings.gradient_accumulation_steps, seed, repeats)
    bucket_sizes = dataset.bucket_sizes  # made from the time ids on each read: once here
    per_bucket = bucket_counts(bucket_sizes, bucket_ids, planner.possible_samples() % len(dataset))
    if per_bucket and max(per_bucket.values()) < global_batch_size:
        raise SystemExit(
            f"Cannot start training: no bucket holds one global batch of --train_batch_size {settings.per_rank_batch} x "
            f"{world_size} process{'es' if world_size > 1 else ''} = {global_batch_size} items (items per bucket"
            f"{', counting the copies of --dataset_repeats' if settings.repeats else ''}: {per_bucket}): lower --train_batch_size "
            "or run on fewer processes"
        )
    first_epoch = planner.epoch_samples(0) % len(dataset)
    too_small = small_buckets(bucket_sizes, bucket_ids, first_epoch, global_batch_size)
    too_long = too_many_epochs(settings.max_updates, bucket_counts(bucket_sizes, bucket_ids, first_epoch), global_batch_size, settings.gradient_accumulation_steps)
    if too_long:
        raise SystemExit(f"Cannot start training: {too_long}")
    del bucket_sizes, first_epoch
    release_freed_memory()  # reading the manifests and choosing the split took several times what is kept
    if is_main and too_small:
        print(
            f"Warning: {sum(too_small.values())} items in buckets smaller than one global batch of {global_batch_size} "
            f"will not be trained on: {too_small}. Lower --train_batch_size or add images of those shapes to use them."
        )
    return TrainingData(settings, dataset, holdout, planner, global_batch_size, identity)
