"""The stream of updates a run trains: each update's microbatches for this rank, read ahead by DataLoader
workers, and the data position a checkpoint records to resume mid-epoch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.distributed.stop_request import ignore_stop_signals
from sdxl_trainer.training.dataset import collate
from sdxl_trainer.training.epochs import EpochPlan, EpochPlanner, rank_slice

# The longest a rank waits for its DataLoader workers' next batch. A read from object storage fails sooner (the
# timeouts in cache/s3_requests.py: at most some 3.2 minutes for a stalled endpoint), and its error reaches the rank;
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
