"""The stream of updates a run trains: each update's microbatches for this rank, read ahead by DataLoader
workers, and the data position a checkpoint records to resume mid-epoch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from sdxl_trainer.cache.format import CacheLocation
from sdxl_trainer.distributed.stop_request import ignore_stop_signals
from sdxl_trainer.training.dataset import CachedDataset, collate
from sdxl_trainer.training.epochs import EpochPlan, EpochPlanner, bucket_counts, rank_slice, small_buckets
from sdxl_trainer.training.holdout import HOLDOUT_FILE, Holdout, HoldoutError, SplitSettings, dataset_item_keys, load_or_choose_holdout


class DataPosition:
    """Where training stands in the data: the epoch to continue, how many optimizer updates of it are done,
    the items carried into it from the previous epoch, and the items it has already trained on.

    The data stream makes one every update, and only a checkpoint reads `consumed`: the items trained since
    an earlier position may be given as `consumed_batches` (global batches, one a row: a view of the epoch's
    plan) and are joined to `consumed` when it is first read, so an update's cost does not grow with the epoch."""

    def __init__(self, epoch: int, updates_in_epoch: int, carried_in: np.ndarray, consumed: np.ndarray,
                 consumed_batches: np.ndarray | None = None):
        self.epoch = epoch
        self.updates_in_epoch = updates_in_epoch
        self.carried_in = carried_in
        self._consumed = consumed
        self._consumed_batches = consumed_batches

    @property
    def consumed(self) -> np.ndarray:
        if self._consumed_batches is not None:
            self._consumed = np.concatenate([self._consumed, self._consumed_batches.reshape(-1)]).astype(np.int64)
            self._consumed_batches = None
        return self._consumed

    @classmethod
    def epoch_start(cls, epoch: int, carried_in: np.ndarray | None = None) -> DataPosition:
        nothing = np.zeros(0, dtype=np.int64)
        return cls(epoch, 0, nothing if carried_in is None else carried_in, nothing)

    def __repr__(self) -> str:
        return f"DataPosition(epoch={self.epoch}, updates_in_epoch={self.updates_in_epoch}, {len(self.carried_in)} carried in, {len(self.consumed)} consumed)"


@dataclass
class Update:
    """One optimizer update's data for this rank, and where the run stands once it is trained."""

    epoch: int
    microbatches: list[dict[str, torch.Tensor]]
    images: int  # in the whole update, all ranks together
    position_after: DataPosition  # what a checkpoint saved after this update must hold
    ends_epoch: bool


class DataStream:
    """The run's remaining optimizer updates in order, each with the data position a checkpoint needs.

    Epochs are planned one at a time as the run reaches them (the number of updates is known at start,
    EpochPlanner.updates_per_epoch), and a position is a few numbers and a view of the epoch's plan, so the
    host's work per update and its memory do not grow with the dataset. One DataLoader reads the whole run
    (every epoch's rank slices in a row), so its worker processes start once instead of at every epoch.
    `sample_index` stays on the host: the per-sample generators read it without a device sync."""

    def __init__(self, dataset: Dataset, planner: EpochPlanner, position: DataPosition, num_epochs: int, rank: int, per_rank_batch: int,
                 num_workers: int, device: torch.device, max_updates: int | None = None):
        """num_epochs: the run's epochs (--num_train_epochs; ignored with max_updates); max_updates: stop after
        that many updates, inside an epoch if need be (--max_train_updates)."""
        self.position = position
        self.device = device
        self.rank, self.per_rank_batch = rank, per_rank_batch
        plans = planner.epoch_plans(num_epochs, position.epoch, position.carried_in, position.consumed, max_updates)
        first = next(plans, None)
        self.updates_per_epoch = [] if first is None else planner.updates_per_epoch(first, num_epochs, position.epoch, max_updates)
        self.num_epochs = len(self.updates_per_epoch)  # planned, the first one perhaps in part (a resume) or not to its end (max_updates)
        self.num_updates = min(sum(self.updates_per_epoch), max_updates) if max_updates is not None else sum(self.updates_per_epoch)
        self._plans = iter(()) if first is None else itertools.chain([first], plans)
        self._planned: dict[int, EpochPlan] = {}  # by epoch index in the run: the one being trained and the loader's, which reads ahead
        self._next_plan = 0
        self.loader = DataLoader(
            dataset,
            batch_sampler=self._rank_slices(),
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=device.type == "cuda",
            worker_init_fn=ignore_stop_signals,
        )

    def _plan(self, index: int) -> EpochPlan:
        while self._next_plan <= index:
            plan = next(self._plans)
            if plan.num_updates != self.updates_per_epoch[self._next_plan]:
                raise RuntimeError(f"bug: epoch {self._next_plan} of the run holds {plan.num_updates} updates, {self.updates_per_epoch[self._next_plan]} counted")
            self._planned[self._next_plan] = plan
            self._next_plan += 1
        return self._planned[index]

    def _updates(self) -> Iterator[tuple[int, int, EpochPlan]]:
        """(epoch index in the run, update in its plan, plan) of every update the stream gives."""
        left = self.num_updates
        for index, count in enumerate(self.updates_per_epoch):
            plan = self._plan(index)  # every epoch's, one without updates too: the next one starts from its carried items
            for update_in_plan in range(count):
                if left == 0:
                    return
                left -= 1
                yield index, update_in_plan, plan

    def _rank_slices(self) -> Iterator[list[int]]:
        for _, update_in_plan, plan in self._updates():
            for batch in plan.update_batches(update_in_plan):
                yield rank_slice(batch, self.rank, self.per_rank_batch)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value if key == "sample_index" else value.to(self.device, non_blocking=True) for key, value in batch.items()}

    def __iter__(self) -> Iterator[Update]:
        batches = iter(self.loader)
        start = self.position
        epoch_start = start
        for index, update_in_plan, plan in self._updates():
            epoch = start.epoch + index
            if update_in_plan == 0 and index > 0:
                epoch_start = DataPosition.epoch_start(epoch, self._planned[index - 1].carried_out)
                for done in [done for done in self._planned if done < index - 1]:
                    del self._planned[done]  # the loader has read past those epochs too (it may still need epoch index - 1's)
            update_batches = plan.update_batches(update_in_plan)
            microbatches = [self._to_device(next(batches)) for _ in update_batches]
            ends_epoch = update_in_plan == plan.num_updates - 1
            if ends_epoch:
                self.position = DataPosition.epoch_start(epoch + 1, plan.carried_out)
            else:
                self.position = DataPosition(
                    epoch, epoch_start.updates_in_epoch + update_in_plan + 1, epoch_start.carried_in, epoch_start.consumed, plan.batches_through(update_in_plan)
                )
            yield Update(epoch, microbatches, int(update_batches.size), self.position, ends_epoch)


@dataclass(frozen=True)
class DataSettings:
    """The training data's flags (the trainer's --cached_dataset_dirs, --dataset_* and batch options)."""

    cache_dirs: list[CacheLocation]
    loss_weights: list[float] | None  # one per cache
    repeats: list[float] | None  # one per cache
    flip_aug: bool
    loss_masks: bool
    per_rank_batch: int
    gradient_accumulation_steps: int
    num_epochs: int
    max_updates: int  # 0: the run is num_epochs long
    num_workers: int
    split: SplitSettings  # the items held out for validation


@dataclass(frozen=True)
class TrainingData:
    """A run's data: the dataset, its held-out items (never trained on) and the epoch planner over the rest."""

    settings: DataSettings
    dataset: CachedDataset
    holdout: Holdout
    planner: EpochPlanner
    global_batch_size: int

    def stream(self, position: DataPosition, first_update: int, rank: int, device: torch.device) -> DataStream:
        """The run's remaining updates from `position` (update `first_update` of the run)."""
        settings = self.settings
        updates_left = max(settings.max_updates - first_update, 0) if settings.max_updates else None
        return DataStream(self.dataset, self.planner, position, settings.num_epochs, rank, settings.per_rank_batch, settings.num_workers, device, updates_left)


def load_training_data(settings: DataSettings, run_dir: Path, seed: int, world_size: int, is_main: bool) -> TrainingData:
    """Open the caches, hold out the validation items (chosen once per run, the same on every rank, saved in
    the run folder) and plan epochs over the rest. Refuses a run in which no bucket holds one global batch
    before the model loads (the planner would plan no batch: a resume with more processes or a larger
    --train_batch_size than the run that saved it gets here too), and warns about items that will not train."""
    dataset = CachedDataset(settings.cache_dirs, settings.loss_weights, flip_aug=settings.flip_aug, loss_masks=settings.loss_masks)
    global_batch_size = settings.per_rank_batch * world_size
    bucket_ids = dataset.bucket_ids()
    try:
        holdout = load_or_choose_holdout(run_dir / HOLDOUT_FILE, dataset_item_keys(dataset), bucket_ids, settings.split, seed, write=is_main)
    except HoldoutError as error:
        raise SystemExit(f"Cannot start training: {error}") from error
    repeats = np.asarray(settings.repeats)[dataset.cache_index] if settings.repeats else None
    planner = EpochPlanner(bucket_ids, holdout.trainable(len(dataset)), global_batch_size, settings.gradient_accumulation_steps, seed, repeats)
    per_bucket = bucket_counts(dataset.bucket_sizes, bucket_ids, planner.possible_samples() % len(dataset))
    if per_bucket and max(per_bucket.values()) < global_batch_size:
        raise SystemExit(
            f"Cannot start training: no bucket holds one global batch of --train_batch_size {settings.per_rank_batch} x "
            f"{world_size} process{'es' if world_size > 1 else ''} = {global_batch_size} items (items per bucket"
            f"{', counting the copies of --dataset_repeats' if settings.repeats else ''}: {per_bucket}): lower --train_batch_size "
            "or run on fewer processes"
        )
    too_small = small_buckets(dataset.bucket_sizes, bucket_ids, planner.epoch_samples(0) % len(dataset), global_batch_size)
    if is_main and too_small:
        print(
            f"Warning: {sum(too_small.values())} items in buckets smaller than one global batch of {global_batch_size} "
            f"will not be trained on: {too_small}. Lower --train_batch_size or add images of those shapes to use them."
        )
    return TrainingData(settings, dataset, holdout, planner, global_batch_size)
