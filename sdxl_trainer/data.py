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
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset

from .cache import FLIPPED_KEY, LOSS_MASK_KEY, TENSOR_KEYS, CacheLocation, CacheReader, captions_in, intact_parts, merge_parts, read_cache_info
from .holdout import HOLDOUT_FILE, Holdout, HoldoutError, SplitSettings, dataset_item_keys, load_or_choose_holdout
from .stop_request import ignore_stop_signals

# A global batch: sample indices (item sample % len(dataset), see Repeats above); an epoch plan holds them as rows.
GlobalBatch = np.ndarray
REPEATS_STREAM = 11  # seed-sequence entry of the fractional-repeat draws, apart from the plan's (seed, epoch)
FLIP_STREAM = 13  # seed-sequence entry of the --flip_aug draws, apart from the noise and caption draws


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


def bucket_counts(bucket_sizes: np.ndarray, bucket_ids: np.ndarray, items: np.ndarray) -> dict[str, int]:
    """How many of `items` each bucket (as "WxH") holds."""
    _, first, counts = np.unique(bucket_ids[items], return_index=True, return_counts=True)
    return {f"{width}x{height}": int(count) for (width, height), count in zip(bucket_sizes[items[first]], counts)}


def small_buckets(bucket_sizes: np.ndarray, bucket_ids: np.ndarray, items: np.ndarray, global_batch_size: int) -> dict[str, int]:
    """Buckets (as "WxH") holding fewer items than one global batch: they can never form a batch."""
    return {bucket: count for bucket, count in bucket_counts(bucket_sizes, bucket_ids, items).items() if count < global_batch_size}


def rank_slice(batch: GlobalBatch, rank: int, per_rank_batch: int) -> list[int]:
    return batch[rank * per_rank_batch : (rank + 1) * per_rank_batch].tolist()


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
