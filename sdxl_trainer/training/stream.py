"""The stream of updates a run trains: each update's microbatches for this rank, read ahead by DataLoader
workers, and the data position a checkpoint records to resume mid-epoch.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from sdxl_trainer.cache.format import LOG_DIR, CacheLocation
from sdxl_trainer.cache.storage import CacheError, open_store
from sdxl_trainer.config import option
from sdxl_trainer.distributed.stop_request import ignore_stop_signals
from sdxl_trainer.runtime.memory import release_freed_memory
from sdxl_trainer.training.dataset import CachedDataset, DatasetOptions, collate
from sdxl_trainer.training.epochs import EpochPlan, EpochPlanner, bucket_counts, rank_slice, small_buckets
from sdxl_trainer.training.holdout import HOLDOUT_FILE, Holdout, HoldoutError, SplitSettings, dataset_item_keys, load_or_choose_holdout

# The longest a rank waits for its DataLoader workers' next batch. A read from object storage fails sooner (the
# timeouts in cache/storage.py: at most some 3.2 minutes for a stalled endpoint), and its error reaches the rank;
# this ends a worker stuck anywhere else (a hung network file system) with a message instead of a run that waits
# forever. The first batch waits for each worker's read of the manifest too (under a minute at 10 M items).
DATALOADER_TIMEOUT_S = 600.0


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

    def state_dict(self) -> dict:
        """What a checkpoint records: the epoch and its updates done (trainer_state.json), the items carried into
        the epoch and those already trained on (data_position.safetensors)."""
        return {"epoch": self.epoch, "updates_in_epoch": self.updates_in_epoch, "carried_in": self.carried_in.astype(np.int64),
                "consumed": self.consumed.astype(np.int64)}

    @classmethod
    def from_state_dict(cls, state: dict) -> DataPosition:
        return cls(state["epoch"], state["updates_in_epoch"], state["carried_in"], state["consumed"])

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
                 num_workers: int, device: torch.device, max_updates: int | None = None,
                 draws: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]] | None = None):
        """num_epochs: the run's epochs (--num_train_epochs; ignored with max_updates); max_updates: stop after
        that many updates, inside an epoch if need be (--max_train_updates); draws(batch, epoch): what each
        batch gets where it is read, in the DataLoader workers (objective.SampleDraws)."""
        self.position = position
        self.first_epoch = position.epoch  # of the stream's first update: epoch index 0 of its plans
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
            EpochBatches(dataset, draws),
            batch_sampler=self._rank_slices(),
            num_workers=num_workers,
            collate_fn=already_collated,
            pin_memory=device.type == "cuda",
            worker_init_fn=ignore_stop_signals,
            timeout=DATALOADER_TIMEOUT_S if num_workers > 0 else 0,
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

    def _rank_slices(self) -> Iterator[list[tuple[int, int]]]:
        """This rank's samples of every microbatch, each with its epoch (EpochBatches draws by it)."""
        for index, update_in_plan, plan in self._updates():
            epoch = self.first_epoch + index
            for batch in plan.update_batches(update_in_plan):
                yield [(epoch, sample) for sample in rank_slice(batch, self.rank, self.per_rank_batch)]

    def _next_batch(self, batches: Iterator[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The loader's next batch; a worker's cache or storage error as its own one line (the DataLoader re-raises
        it with the worker's whole traceback as its message), a stalled worker as a CacheError."""
        waited_from = time.monotonic()
        try:
            return next(batches)
        except CacheError as error:
            message = worker_message(error)
            if message is None:
                raise
            raise type(error)(message) from None
        except RuntimeError:
            if self.loader.timeout and time.monotonic() - waited_from >= self.loader.timeout:
                raise CacheError(
                    f"no batch from the DataLoader workers in {self.loader.timeout:.0f} s: their reads of the caches hang (a stalled file "
                    "system or storage); check that the caches' file system or object storage answers, then re-run"
                ) from None
            raise

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
            microbatches = [self._to_device(self._next_batch(batches)) for _ in update_batches]
            ends_epoch = update_in_plan == plan.num_updates - 1
            if ends_epoch:
                self.position = DataPosition.epoch_start(epoch + 1, plan.carried_out)
            else:
                self.position = DataPosition(
                    epoch, epoch_start.updates_in_epoch + update_in_plan + 1, epoch_start.carried_in, epoch_start.consumed, plan.batches_through(update_in_plan)
                )
            yield Update(epoch, microbatches, int(update_batches.size), self.position, ends_epoch)


class EpochBatches(Dataset):
    """The dataset read a microbatch at a time, as (epoch, sample) pairs: the batch collated, with its draws
    (`draws(batch, epoch)`) made here, in the DataLoader worker that reads it."""

    def __init__(self, dataset: Dataset, draws: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]] | None):
        self.dataset = dataset
        self.draws = draws

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, pairs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        epoch, samples = pairs[0][0], [sample for _, sample in pairs]
        read_many = getattr(self.dataset, "__getitems__", None)  # a batch at once where the dataset can (CachedDataset)
        batch = collate(read_many(samples) if read_many else [self.dataset[sample] for sample in samples])
        return batch if self.draws is None else self.draws(batch, epoch)


def already_collated(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DataLoader's collate step for EpochBatches, whose batches come collated."""
    return batch


def worker_message(error: CacheError) -> str | None:
    """The message a DataLoader worker's CacheError had in the worker (None: not a worker's). The DataLoader
    raises the same class in the training process with "Caught StorageError in DataLoader worker process 0.
    Original Traceback ..." and the worker's traceback as its message, whose last line is "module.Class: message"."""
    text = str(error)
    if not text.startswith(f"Caught {type(error).__name__} in DataLoader worker process"):
        return None
    return text.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]


@dataclass(kw_only=True)
class DataOptions:
    """Data: caches, batches, run length"""

    datasets: list[DatasetOptions] = option(
        [], help="the caches, one [[datasets]] table each in a TOML --config (keys: " + ", ".join(field.name for field in fields(DatasetOptions))
        + "); instead of --cached_dataset_dirs and the --dataset_* flags, not beside them",
    )
    cached_dataset_dirs: list[str] | None = option(
        None,
        help="caches written by sdxl_process_data_dir.py (one or more): folders, or s3://bucket/prefix in S3-compatible object storage "
        "(read with ranged requests; credentials the standard AWS way, AWS_ENDPOINT_URL_S3 for MinIO, R2, B2)"
    )
    dataset_repeats: list[float] | None = option(
        None,
        help="times each --cached_dataset_dirs entry's items are trained per epoch, one number per entry in the same order: 3 = three "
        "copies, each with its own noise and caption draws; 0.5 = a seeded half of the items, another half every epoch; None = 1 for all",
    )
    dataset_loss_weights: list[float] | None = option(
        None,
        help="a weight for each --cached_dataset_dirs entry's training loss, one number per entry in the same order (kohya's prior_loss_weight, "
        "OneTrainer's concept loss_weight): each sample's loss is multiplied by its cache's weight before the batch mean, so 0.5 halves "
        "that cache's pull on the weights; the validation loss stays unweighted; None = 1 for all",
    )
    dataset_shuffle_caption: list[bool] | None = option(
        None,
        help="--shuffle_caption for each --cached_dataset_dirs entry, in the same order (true/false), e.g. shuffle a tag dataset's "
        "captions and keep a prose dataset's as written; None = --shuffle_caption for all",
    )
    dataset_keep_tokens: list[int] | None = option(None, help="--keep_tokens for each --cached_dataset_dirs entry, in the same order; None = --keep_tokens for all")
    dataset_caption_tag_dropout_rate: list[float] | None = option(
        None, help="--caption_tag_dropout_rate for each --cached_dataset_dirs entry, in the same order; None = --caption_tag_dropout_rate for all"
    )
    validation_source_dirs: list[Path] | None = option(
        None, help="the image folders the caches were made from (one per cache, same order): real images for FID/LPIPS; None = decoded cached latents"
    )
    train_batch_size: int = option(1, help="images per GPU per microbatch")
    gradient_accumulation_steps: int = option(1, help="microbatches per optimizer update; effective batch = train_batch_size x processes x this")
    num_train_epochs: int = option(10, help="passes over the training items")
    max_train_updates: int = option(
        0,
        help="train this many optimizer updates in all, as many epochs or part of one as that takes, instead of --num_train_epochs "
        "(kohya's --max_train_steps); the LR schedule spans them; 0 = off",
    )
    dataloader_num_workers: int = option(2, help="background processes reading cache shards per rank; 0 = read in the training process")
    flip_aug: bool = option(
        False,
        help="train each sample's horizontal mirror half the time (drawn per sample and epoch from the seed), from latents the cache "
        "holds (sdxl_process_data_dir.py --flip_aug), with SDXL's crop offset of the mirrored crop; for subjects without a handedness",
    )

    def dataset_records(self) -> list[DatasetOptions]:
        """One record per cache: the [[datasets]] tables as given, or each --cached_dataset_dirs entry with the
        --dataset_* and --validation_source_dirs values at its position (unset = 1 for repeats and loss weight,
        the run-wide flag for the caption options). problems() has checked that the lists fit."""
        if self.datasets:
            return list(self.datasets)
        cache_dirs = self.cached_dataset_dirs or []

        def per_cache(values: list | None, default: object = None) -> list:
            return values if values is not None else [default] * len(cache_dirs)

        return [
            DatasetOptions(cache_dir=cache_dir, repeats=repeats, loss_weight=weight, shuffle_caption=shuffle, keep_tokens=keep,
                           caption_tag_dropout_rate=dropout, validation_source_dir=source)
            for cache_dir, repeats, weight, shuffle, keep, dropout, source in zip(
                cache_dirs, per_cache(self.dataset_repeats, 1.0), per_cache(self.dataset_loss_weights, 1.0), per_cache(self.dataset_shuffle_caption),
                per_cache(self.dataset_keep_tokens), per_cache(self.dataset_caption_tag_dropout_rate), per_cache(self.validation_source_dirs),
            )
        ]  # fmt: skip

    def problems(self) -> list[str]:
        problems = []
        shorthand = [name for name in SHORTHAND_FLAGS if getattr(self, name) is not None]
        if self.datasets and shorthand:
            problems.append(f"give the caches either as [[datasets]] tables in --config or as --cached_dataset_dirs (with {', '.join('--' + name for name in SHORTHAND_FLAGS[1:])}), not both: found {', '.join('--' + name for name in shorthand)}")
        elif not self.datasets and not self.cached_dataset_dirs:
            problems.append("no caches to train on: give --cached_dataset_dirs (or [[datasets]] tables in a --config file)")
        count = len(self.cached_dataset_dirs or [])
        for name in ("dataset_repeats", "dataset_loss_weights"):  # one positive number per cache
            values = getattr(self, name)
            if values is not None and len(values) != count:
                problems.append(f"--{name} needs one number per --cached_dataset_dirs entry ({count}), got {len(values)}")
            if any(not 0 < value < math.inf for value in values or ()):
                problems.append(f"--{name} must be > 0 and finite (leave a cache out instead of 0), got {values}")
        if self.validation_source_dirs is not None and len(self.validation_source_dirs) != count:
            problems.append("--validation_source_dirs needs one image folder per --cached_dataset_dirs entry, in the same order")
        for name in ("dataset_shuffle_caption", "dataset_keep_tokens", "dataset_caption_tag_dropout_rate"):  # one value per cache
            values = getattr(self, name)
            if values is not None and len(values) != count:
                problems.append(f"--{name} needs one value per --cached_dataset_dirs entry ({count}), got {len(values)}")
        for number, record in enumerate(self.datasets, start=1):
            if not 0 < record.repeats < math.inf or not 0 < record.loss_weight < math.inf:
                problems.append(f"[[datasets]] number {number} ({record.cache_dir}): repeats and loss_weight must be > 0 and finite (leave a cache out instead of 0)")
        sources = [record.validation_source_dir is not None for record in self.datasets]
        if any(sources) and not all(sources):
            problems.append("[[datasets]]: give validation_source_dir for every cache or for none (FID and LPIPS compare with all real images or all decoded latents)")
        for name in ("train_batch_size", "gradient_accumulation_steps", "num_train_epochs"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        if self.max_train_updates < 0:
            problems.append("--max_train_updates must be >= 0 (0 = --num_train_epochs decides)")
        if self.dataloader_num_workers < 0:
            problems.append(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        return problems


# The per-cache flags that DataOptions.datasets replaces, --cached_dataset_dirs first.
SHORTHAND_FLAGS = ("cached_dataset_dirs", "dataset_repeats", "dataset_loss_weights", "dataset_shuffle_caption", "dataset_keep_tokens",
                   "dataset_caption_tag_dropout_rate", "validation_source_dirs")


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
    captions_in_memory: bool  # caption mode reads every step's captions: held, not read from the manifest on use


@dataclass(frozen=True)
class TrainingData:
    """A run's data: the dataset, its held-out items (never trained on) and the epoch planner over the rest."""

    settings: DataSettings
    dataset: CachedDataset
    holdout: Holdout
    planner: EpochPlanner
    global_batch_size: int

    def stream(self, position: DataPosition, first_update: int, rank: int, device: torch.device,
               draws: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]] | None = None) -> DataStream:
        """The run's remaining updates from `position` (update `first_update` of the run), each batch with its `draws`."""
        settings = self.settings
        updates_left = max(settings.max_updates - first_update, 0) if settings.max_updates else None
        return DataStream(self.dataset, self.planner, position, settings.num_epochs, rank, settings.per_rank_batch, settings.num_workers, device,
                          updates_left, draws)


def load_training_data(settings: DataSettings, run_dir: Path, seed: int, world_size: int, is_main: bool) -> TrainingData:
    """Open the caches, hold out the validation items (chosen once per run, the same on every rank, saved in
    the run folder) and plan epochs over the rest. Refuses a run in which no bucket holds one global batch
    before the model loads (the planner would plan no batch: a resume with more processes or a larger
    --train_batch_size than the run that saved it gets here too), and warns about items that will not train."""
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
    global_batch_size = settings.per_rank_batch * world_size
    bucket_ids = dataset.bucket_ids()
    try:
        holdout = load_or_choose_holdout(run_dir / HOLDOUT_FILE, dataset_item_keys(dataset), bucket_ids, settings.split, seed, write=is_main)
    except HoldoutError as error:
        raise SystemExit(f"Cannot start training: {error}") from error
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
    too_small = small_buckets(bucket_sizes, bucket_ids, planner.epoch_samples(0) % len(dataset), global_batch_size)
    del bucket_sizes
    release_freed_memory()  # reading the manifests and choosing the split took several times what is kept
    if is_main and too_small:
        print(
            f"Warning: {sum(too_small.values())} items in buckets smaller than one global batch of {global_batch_size} "
            f"will not be trained on: {too_small}. Lower --train_batch_size or add images of those shapes to use them."
        )
    return TrainingData(settings, dataset, holdout, planner, global_batch_size)
