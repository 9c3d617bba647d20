"""Training data from one or more caches: the dataset of cached items and the bucketed epoch plan.

Epoch plan (the same on every rank, from the seed alone):
  - per bucket: the items carried over from the previous epoch come first, then the bucket's other items
    in a seeded random order; the stream is cut into global batches of train_batch_size x world_size;
  - the rest of each bucket (too few for a global batch) is carried over to the next epoch;
  - all global batches are shuffled together, then those holding carried-over items are moved to the
    front; each optimizer update takes gradient_accumulation_steps of them in order, and the epoch's
    last update takes whatever is left (it may have fewer microbatches; its loss is still the mean
    over its samples), so no whole batch is ever held back;
  - rank r takes items [r * train_batch_size, (r + 1) * train_batch_size) of each global batch.
So within an epoch every item is used at most once, every batch comes from one bucket, and an item left
out of an epoch (only ever a bucket's remainder) is trained in the first updates of the next one.

Repeats (--dataset_repeats, one number per cache): the plan's units are samples, copy k of item i being
sample k * num_items + i (copy 0 is the item's own index). An item with repeats r has copies 0 .. floor(r)-1
in every epoch, and copy floor(r) in the epoch for a share r - floor(r) of its cache's items, chosen anew
each epoch from the seed (exactly that share, rounded). Everything above holds for samples: each copy is
planned like an item, and draws its own noise and caption (diffusion.py, captions.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

# A global batch: sample indices (item sample % len(dataset), see Repeats above); an epoch plan holds them as rows.
GlobalBatch = np.ndarray


REPEATS_STREAM = 11  # seed-sequence entry of the fractional-repeat draws, apart from the plan's (seed, epoch)


@dataclass
class EpochPlan:
    batches: np.ndarray  # (number of global batches, global_batch_size) int64: the global batches in training order
    carried_out: np.ndarray  # items left for the next epoch
    accumulation_steps: int  # global batches per optimizer update (the last update may have fewer)

    @property
    def num_updates(self) -> int:
        return math.ceil(len(self.batches) / self.accumulation_steps)

    def update_batches(self, update_in_plan: int) -> np.ndarray:
        """The global batches (rows) of the plan's update `update_in_plan` (counted from 0)."""
        first = update_in_plan * self.accumulation_steps
        return self.batches[first : first + self.accumulation_steps]

    def batches_through(self, update_in_plan: int) -> np.ndarray:
        """The global batches of updates 0 .. update_in_plan (a view)."""
        return self.batches[: (update_in_plan + 1) * self.accumulation_steps]


class EpochPlanner:
    """Deterministic bucketed epoch plans; see the module docstring for the rules."""

    def __init__(self, bucket_ids: np.ndarray, trainable: np.ndarray, global_batch_size: int, accumulation_steps: int, seed: int,
                 repeats: np.ndarray | None = None):
        """`repeats`: per item, its cache's --dataset_repeats (None: 1 for every item)."""
        self.global_batch_size = global_batch_size
        self.accumulation_steps = accumulation_steps
        self.seed = seed
        self.bucket_of = bucket_ids
        self.num_items = len(bucket_ids)
        self.trainable = np.sort(trainable).astype(np.int64)
        self.repeats = np.ones(self.num_items) if repeats is None else np.asarray(repeats, dtype=np.float64)

    def epoch_samples(self, epoch: int) -> np.ndarray:
        """The samples (sorted) of `epoch` by the repeat rule of the module docstring."""
        whole = np.floor(self.repeats[self.trainable]).astype(np.int64)
        samples = [self.trainable[whole > copy] + copy * self.num_items for copy in range(int(whole.max(initial=0)))]
        rng = np.random.default_rng([self.seed, epoch, REPEATS_STREAM])
        for repeat in np.unique(self.repeats[self.trainable]):
            share = repeat - math.floor(repeat)
            if share:
                items = self.trainable[self.repeats[self.trainable] == repeat]
                chosen = rng.permutation(items)[: round(share * len(items))]
                samples.append(chosen + math.floor(repeat) * self.num_items)
        return np.sort(np.concatenate(samples)) if samples else np.zeros(0, dtype=np.int64)

    def possible_samples(self) -> np.ndarray:
        """Every sample some epoch may plan: copies 0 .. ceil(r)-1 of each trainable item with repeats r. A
        plan's batch of a bucket holds distinct samples, so a bucket with fewer than one global batch of
        them can never form a batch, in any epoch."""
        copies = np.ceil(self.repeats[self.trainable]).astype(np.int64)
        samples = [self.trainable[copies > copy] + copy * self.num_items for copy in range(int(copies.max(initial=0)))]
        return np.concatenate([np.zeros(0, dtype=np.int64), *samples])

    def plan(self, epoch: int, carried_in: np.ndarray, exclude: np.ndarray | None = None) -> EpochPlan:
        """The epoch's plan; `exclude` leaves samples out (those a resumed epoch has already trained on)."""
        samples = self.epoch_samples(epoch)
        rng = np.random.default_rng([self.seed, epoch])
        if exclude is not None and len(exclude):
            carried_in = np.setdiff1d(carried_in, exclude)
        sample_buckets, carried_buckets = self.bucket_of[samples % self.num_items], self.bucket_of[carried_in % self.num_items]
        batches: list[np.ndarray] = []  # per bucket, its global batches as rows
        leftovers: list[np.ndarray] = []
        for bucket in np.unique(np.concatenate([sample_buckets, carried_buckets])):
            items = samples[sample_buckets == bucket]
            carried_here = carried_in[carried_buckets == bucket]
            fresh = np.setdiff1d(items, carried_here, assume_unique=True)
            if exclude is not None and len(exclude):
                fresh = np.setdiff1d(fresh, exclude, assume_unique=True)
            stream = np.concatenate([carried_here, rng.permutation(fresh)]).astype(np.int64)
            full = len(stream) // self.global_batch_size * self.global_batch_size
            batches.append(stream[:full].reshape(-1, self.global_batch_size))
            leftovers.append(stream[full:])
        all_batches = np.concatenate([np.zeros((0, self.global_batch_size), dtype=np.int64), *batches])
        order = rng.permutation(len(all_batches))
        # Batches holding carried-over items go first (in shuffled order, as the others): those items have
        # waited an epoch already.
        holds_carried = np.isin(all_batches[order], carried_in).any(axis=1)
        order = np.concatenate([order[holds_carried], order[~holds_carried]])
        carried_out = np.concatenate(leftovers).astype(np.int64) if leftovers else np.zeros(0, dtype=np.int64)
        return EpochPlan(all_batches[order], carried_out, self.accumulation_steps)

    def plans(self, num_epochs: int, start_epoch: int = 0, carried_in: np.ndarray | None = None, consumed: np.ndarray | None = None,
              max_updates: int | None = None) -> list[EpochPlan]:
        """All of epoch_plans' plans at once (for tests and small runs: the stream plans one epoch at a time)."""
        return list(self.epoch_plans(num_epochs, start_epoch, carried_in, consumed, max_updates))

    def epoch_plans(self, num_epochs: int, start_epoch: int = 0, carried_in: np.ndarray | None = None, consumed: np.ndarray | None = None,
                    max_updates: int | None = None) -> Iterator[EpochPlan]:
        """Plans of epochs start_epoch .. num_epochs-1, or with max_updates of as many epochs as hold that many
        updates (the last one whole: the run stops inside it). A resumed run passes the position it saved:
        the items carried into start_epoch and those start_epoch already trained on; its first plan then
        holds only the rest of that epoch. With an unchanged global batch and accumulation this is exactly
        the rest of the original plan (same batches, same order); otherwise the untrained items are planned
        anew. Each epoch is planned when the one before it has been read."""
        carried = np.zeros(0, dtype=np.int64) if carried_in is None else carried_in
        consumed = np.zeros(0, dtype=np.int64) if consumed is None else consumed
        planned_updates = 0
        epochs = itertools.count(start_epoch) if max_updates is not None else range(start_epoch, num_epochs)
        for epoch in epochs:
            if max_updates is not None and planned_updates >= max_updates:
                return
            plan = self.plan(epoch, carried)
            if epoch == start_epoch and len(consumed):
                plan = self._rest_of_epoch(epoch, carried, plan, consumed)
            if max_updates is not None and plan.num_updates == 0 and epoch > start_epoch:
                return  # no epoch holds an update: the run cannot reach max_updates
            yield plan
            planned_updates += plan.num_updates
            carried = plan.carried_out

    def updates_per_epoch(self, first: EpochPlan, num_epochs: int, start_epoch: int = 0, max_updates: int | None = None) -> list[int]:
        """The updates of each plan epoch_plans yields when its first plan (of start_epoch) is `first`, found
        without planning the later epochs where their batch counts follow from bucket sizes alone: with whole
        repeats every epoch plans the same samples, and once the carried-over ones are among them each bucket
        forms floor(its samples / global batch) batches every epoch, whichever samples are carried. Fractional
        repeats (another share each epoch) plan every later epoch here, one at a time."""
        counts = [first.num_updates]
        repeats = self.repeats[self.trainable]
        samples = self.epoch_samples(start_epoch + 1)
        if np.any(repeats != np.floor(repeats)) or not np.isin(first.carried_out, samples).all():
            left = None if max_updates is None else max_updates - first.num_updates
            for plan in self.epoch_plans(num_epochs, start_epoch + 1, first.carried_out, None, left) if left is None or left > 0 else ():
                if max_updates is not None and plan.num_updates == 0:
                    break  # as epoch_plans stops: no epoch holds an update
                counts.append(plan.num_updates)
            return counts
        _, per_bucket = np.unique(self.bucket_of[samples % self.num_items], return_counts=True)
        per_epoch = math.ceil(int((per_bucket // self.global_batch_size).sum()) / self.accumulation_steps)
        if max_updates is None:
            return counts + [per_epoch] * max(num_epochs - start_epoch - 1, 0)
        if per_epoch == 0 or first.num_updates >= max_updates:
            return counts
        return counts + [per_epoch] * math.ceil((max_updates - first.num_updates) / per_epoch)

    def _rest_of_epoch(self, epoch: int, carried_in: np.ndarray, full_plan: EpochPlan, consumed: np.ndarray) -> EpochPlan:
        done_batches, remainder = divmod(len(consumed), self.global_batch_size)
        # A plan may hold fewer batches than were done: a resume with a larger global batch.
        planned_prefix = full_plan.batches[:done_batches].reshape(-1)
        at_update_boundary = done_batches % self.accumulation_steps == 0 or done_batches == len(full_plan.batches)
        if remainder == 0 and at_update_boundary and np.array_equal(np.sort(planned_prefix), np.sort(consumed)):
            return EpochPlan(full_plan.batches[done_batches:], full_plan.carried_out, self.accumulation_steps)
        return self.plan(epoch, carried_in, exclude=consumed)


# What a run's plan holds. Every rank plans each epoch whole: the plan keeps one int64 a sample, and planning makes
# several temporaries of the same length, so this many samples take several GB of every rank's memory for a moment.
MAX_EPOCH_SAMPLES = 2**27
# The run's epochs are counted up front, one number each (EpochPlanner.updates_per_epoch).
MAX_EPOCHS = 1_000_000


def too_many_samples(items_per_cache: np.ndarray, repeats: list[float] | None) -> str:
    """Why an epoch of these caches (items, and repeats per cache) holds more samples than a plan can: "" if it
    does not. Checked before anything is planned, which would otherwise grow every rank's memory without a word."""
    repeats = repeats or [1.0] * len(items_per_cache)
    per_cache = [math.ceil(int(items) * repeat) for items, repeat in zip(items_per_cache, repeats)]
    if sum(per_cache) <= MAX_EPOCH_SAMPLES:
        return ""
    largest = int(np.argmax(per_cache))
    return (
        f"an epoch would hold {sum(per_cache):,} samples, more than the {MAX_EPOCH_SAMPLES:,} a plan holds (every rank plans each epoch "
        f"whole); the largest part is cache number {largest + 1}: {int(items_per_cache[largest]):,} items x repeats {repeats[largest]:g}. "
        "Lower its repeats (repeats in its [[datasets]] table, or --dataset_repeats), or train fewer items an epoch"
    )


def too_many_epochs(max_updates: int, bucket_items: dict[str, int], global_batch_size: int, accumulation_steps: int) -> str:
    """Why --max_train_updates would take more epochs than MAX_EPOCHS at the first epoch's updates (`bucket_items`:
    its samples per bucket); "" if not (0: off). --num_train_epochs is checked with the flags (DataOptions)."""
    if not max_updates:
        return ""
    per_epoch = math.ceil(sum(count // global_batch_size for count in bucket_items.values()) / accumulation_steps)
    epochs = math.ceil(max_updates / max(per_epoch, 1))
    if epochs <= MAX_EPOCHS:
        return ""
    return (
        f"--max_train_updates {max_updates:,} takes {epochs:,} epochs of {per_epoch:,} updates, more than the {MAX_EPOCHS:,} epochs a "
        "run plans: lower --max_train_updates"
    )


def bucket_counts(bucket_sizes: np.ndarray, bucket_ids: np.ndarray, items: np.ndarray) -> dict[str, int]:
    """How many of `items` each bucket (as "WxH") holds."""
    _, first, counts = np.unique(bucket_ids[items], return_index=True, return_counts=True)
    return {f"{width}x{height}": int(count) for (width, height), count in zip(bucket_sizes[items[first]], counts)}


def small_buckets(bucket_sizes: np.ndarray, bucket_ids: np.ndarray, items: np.ndarray, global_batch_size: int) -> dict[str, int]:
    """Buckets (as "WxH") holding fewer items than one global batch: they can never form a batch."""
    return {bucket: count for bucket, count in bucket_counts(bucket_sizes, bucket_ids, items).items() if count < global_batch_size}


def rank_slice(batch: GlobalBatch, rank: int, per_rank_batch: int) -> list[int]:
    return batch[rank * per_rank_batch : (rank + 1) * per_rank_batch].tolist()
