"""The bucketed epoch plan (EpochPlanner), per-rank slices of a global batch, small-bucket warnings, and the
cached dataset's per-item micro-conditioning."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._utils import ExceptionWrapper

from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.format import CachedItem, CacheSettings, write_cache_info
from sdxl_trainer.cache.writer import ShardWriter
from sdxl_trainer.training.dataset import CachedDataset, collate
from sdxl_trainer.training.epochs import EpochPlanner, rank_slice, small_buckets
from sdxl_trainer.training.stream import DataPosition, DataStream, worker_message

# --- helpers ----------------------------------------------------------------------------------------------


def bucket_ids_for(counts: list[int]) -> np.ndarray:
    """Items 0..N-1 laid out bucket after bucket: counts [7, 5, 2] -> seven 0s, five 1s, two 2s (shuffled order
    would do too; contiguous keeps the expectations readable)."""
    return np.repeat(np.arange(len(counts)), counts).astype(np.int64)


def planner(counts: list[int], global_batch: int = 2, accumulation: int = 1, seed: int = 0, trainable=None) -> EpochPlanner:
    ids = bucket_ids_for(counts)
    items = np.arange(len(ids)) if trainable is None else np.asarray(trainable)
    return EpochPlanner(ids, items, global_batch, accumulation, seed)


def used_items(plan) -> list[int]:
    return [int(item) for batch in plan.batches for item in batch]


CASES = [
    pytest.param([7, 5, 2], 2, 1, id="7-5-2_gb2_acc1"),
    pytest.param([7, 5, 2], 2, 2, id="7-5-2_gb2_acc2"),
    pytest.param([7, 5, 4], 2, 2, id="7-5-4_gb2_acc2"),  # 7 batches: the last update has one
    pytest.param([9, 6, 3], 3, 2, id="9-6-3_gb3_acc2"),
    pytest.param([11, 4], 4, 3, id="11-4_gb4_acc3"),
]


# --- EpochPlanner -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts,global_batch,accumulation", CASES)
def test_plan_invariants(counts, global_batch, accumulation):
    ids = bucket_ids_for(counts)
    every_item = set(range(len(ids)))
    for seed in range(5):
        plans = planner(counts, global_batch, accumulation, seed).plans(6)
        for plan in plans:
            assert len(plan.batches), "these datasets always make at least one update"
            for batch in plan.batches:
                assert batch.shape == (global_batch,)
                assert len(set(ids[batch].tolist())) == 1, "a batch mixes buckets"
            assert plan.num_updates == -(-len(plan.batches) // accumulation)
            assert sum(len(plan.update_batches(u)) for u in range(plan.num_updates)) == len(plan.batches)
            used = used_items(plan)
            assert len(used) == len(set(used)), "an item appears twice in one epoch"
            carried = plan.carried_out.tolist()
            # Used + carried out = every trainable item, each exactly once.
            assert sorted(used + carried) == sorted(every_item)
            assert plan.carried_out.dtype == np.int64


def test_buckets_need_not_be_contiguous():
    ids = np.array([2, 0, 1, 0, 2, 1, 0, 0, 1, 2, 0, 1], dtype=np.int64)
    for seed in range(5):
        plans = EpochPlanner(ids, np.arange(len(ids)), 2, 1, seed).plans(3)
        for plan in plans:
            assert all(len(set(ids[batch].tolist())) == 1 for batch in plan.batches)
            assert sorted(used_items(plan) + plan.carried_out.tolist()) == list(range(len(ids)))


def test_hand_checked_counts():
    # Buckets 7, 5, 2 with global batch 2: 3 + 2 + 1 = 6 batches, items 6 (from bucket 0) and one of bucket 1 left.
    plan = planner([7, 5, 2]).plan(0, np.zeros(0, dtype=np.int64))
    assert len(plan.batches) == 6
    assert Counter(int(bucket_ids_for([7, 5, 2])[b[0]]) for b in plan.batches) == {0: 3, 1: 2, 2: 1}
    assert len(plan.carried_out) == 2
    assert sorted(bucket_ids_for([7, 5, 2])[plan.carried_out].tolist()) == [0, 1]


def test_last_update_of_an_epoch_takes_the_remaining_batches():
    # Buckets 7, 5, 4 with global batch 2 make 7 batches; accumulation 2 gives updates of 2, 2, 2 and 1 batch.
    plan = planner([7, 5, 4], accumulation=2).plan(0, np.zeros(0, dtype=np.int64))
    assert len(plan.batches) == 7 and plan.num_updates == 4
    assert [len(plan.update_batches(u)) for u in range(4)] == [2, 2, 2, 1]
    assert len(plan.carried_out) == 1 + 1  # only one leftover from each odd bucket


@pytest.mark.parametrize(
    "counts,global_batch,accumulation",
    [([7, 5, 2], 2, 1), ([9, 6, 5], 4, 1), ([13, 8, 5], 3, 1), ([7, 5, 2], 2, 2)],  # the last: 6 batches, none held back
)
def test_carried_items_are_used_in_the_next_epoch(counts, global_batch, accumulation):
    # When only bucket remainders are carried (every bucket here holds at least one global batch), they lead
    # their bucket's stream next epoch, so each is used exactly once there.
    for seed in range(5):
        plans = planner(counts, global_batch, accumulation, seed).plans(5)
        for previous, current in zip(plans, plans[1:]):
            used = Counter(used_items(current))
            assert all(used[int(item)] == 1 for item in previous.carried_out), (seed, previous.carried_out, used)


def test_carried_items_are_used_in_the_next_epoch_with_accumulation():
    for seed in range(10):
        plans = planner([7, 5, 4], 2, 2, seed).plans(5)
        for previous, current in zip(plans, plans[1:]):
            used = set(used_items(current))
            assert set(previous.carried_out.tolist()) <= used, (seed, previous.carried_out)


def test_same_seed_same_plan_other_seed_other_order():
    def flat(plans):
        return [[batch.tolist() for batch in plan.batches] + [plan.carried_out.tolist()] for plan in plans]

    assert flat(planner([7, 5, 2], seed=11).plans(4)) == flat(planner([7, 5, 2], seed=11).plans(4))
    assert flat(planner([7, 5, 2], seed=11).plans(4)) != flat(planner([7, 5, 2], seed=12).plans(4))


def test_epochs_differ():
    first, second = planner([7, 5, 2], seed=3).plans(2)
    assert [b.tolist() for b in first.batches] != [b.tolist() for b in second.batches]


def test_plan_is_a_function_of_seed_epoch_and_carried_items():
    # Any rank (or a resumed run) can rebuild epoch e from the seed and the carried items alone.
    p = planner([7, 5, 2], seed=5)
    plans = p.plans(3)
    again = p.plan(2, plans[1].carried_out)
    assert [b.tolist() for b in again.batches] == [b.tolist() for b in plans[2].batches]
    assert again.carried_out.tolist() == plans[2].carried_out.tolist()


def test_only_trainable_items_are_planned():
    ids = bucket_ids_for([7, 5, 2])
    trainable = np.array([0, 1, 2, 3, 7, 8, 9, 12, 13])  # items 4, 5, 6, 10, 11 excluded
    plans = planner([7, 5, 2], trainable=trainable).plans(3)
    for plan in plans:
        used = used_items(plan)
        assert sorted(used + plan.carried_out.tolist()) == trainable.tolist()
        assert all(len(set(ids[batch].tolist())) == 1 for batch in plan.batches)


def test_bucket_smaller_than_global_batch_is_always_carried():
    # Bucket 2 holds 1 item, global batch 2: it can never form a batch.
    plans = planner([4, 1], global_batch=2).plans(3)
    for plan in plans:
        assert 4 not in used_items(plan)
        assert 4 in plan.carried_out.tolist()


def test_no_items_no_batches():
    plan = EpochPlanner(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 2, 1, 0).plan(0, np.zeros(0, dtype=np.int64))
    assert len(plan.batches) == 0 and plan.carried_out.tolist() == []


def test_a_resume_whose_global_batch_no_bucket_fills_plans_the_rest_of_the_epoch_as_carried_items():
    """A checkpoint saved after 4 batches of 2, resumed with a global batch of 8 (more processes): no batch
    can form, so every item not yet trained on is carried (the trainer refuses such a run before it starts)."""
    consumed = np.concatenate(planner([6, 5], global_batch=2).plan(0, np.zeros(0, dtype=np.int64)).batches[:4])
    plans = planner([6, 5], global_batch=8).plans(1, 0, None, consumed)
    assert [len(plan.batches) for plan in plans] == [0]
    assert sorted(plans[0].carried_out.tolist()) == sorted(set(range(11)) - set(consumed.tolist()))


def test_possible_samples_are_every_copy_any_epoch_may_plan():
    ids = bucket_ids_for([2, 2])
    planner_with_repeats = EpochPlanner(ids, np.array([0, 1, 3]), 2, 1, 0, repeats=np.array([1.5, 1.0, 2.0, 0.5]))
    # Item 0 (1.5): copies 0 and 1; item 1: copy 0; item 2 is held out; item 3 (0.5): copy 0 in some epochs.
    assert sorted(planner_with_repeats.possible_samples().tolist()) == [0, 1, 3, 4]
    for epoch in range(5):
        assert set(planner_with_repeats.epoch_samples(epoch).tolist()) <= {0, 1, 3, 4}


# --- rank_slice and small_buckets -------------------------------------------------------------------------


def test_rank_slice():
    batch = np.array([10, 11, 12, 13])
    assert rank_slice(batch, 0, 2) == [10, 11]
    assert rank_slice(batch, 1, 2) == [12, 13]
    assert all(type(item) is int for item in rank_slice(batch, 0, 2))
    assert [rank_slice(batch, rank, 1) for rank in range(4)] == [[10], [11], [12], [13]]


def test_rank_slices_partition_every_planned_batch():
    for plan in planner([9, 6, 3], global_batch=4).plans(2):
        for batch in plan.batches:
            assert rank_slice(batch, 0, 2) + rank_slice(batch, 1, 2) == batch.tolist()


def test_a_dataloader_workers_storage_error_gets_its_own_message_back():
    """The DataLoader re-raises a worker's error in the training process with the worker's traceback as its
    message; the stream gives the rank (and the watchdog, which prints it) the worker's one line."""
    try:
        try:
            raise TimeoutError("read timeout")
        except TimeoutError as cause:
            raise StorageError("reading s3://bucket/cache/shards/w0-000000.safetensors failed: no answer") from cause
    except StorageError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(StorageError) as raised:
        wrapped.reraise()
    assert "Traceback" in str(raised.value)
    assert worker_message(raised.value) == "reading s3://bucket/cache/shards/w0-000000.safetensors failed: no answer"
    assert worker_message(StorageError("raised in this process")) is None


def test_small_buckets():
    # Item sizes (width, height): three 1024x1024, one 832x1216, two 1216x832.
    sizes = np.array([[1024, 1024], [832, 1216], [1024, 1024], [1216, 832], [1024, 1024], [1216, 832]])
    ids = sizes[:, 0].astype(np.int64) * 100_000 + sizes[:, 1]
    items = np.arange(len(sizes))
    assert small_buckets(sizes, ids, items, 3) == {"832x1216": 1, "1216x832": 2}
    assert small_buckets(sizes, ids, items, 2) == {"832x1216": 1}
    assert small_buckets(sizes, ids, items, 1) == {}
    # Only the given items count.
    assert small_buckets(sizes, ids, np.array([0, 2, 3]), 2) == {"1216x832": 1}


# --- CachedDataset ----------------------------------------------------------------------------------------


def test_cached_dataset_time_ids_and_bucket_ids(tmp_path):
    def item(path, width, height, original, crop, seed):
        generator = torch.Generator().manual_seed(seed)
        return CachedItem(
            latents=torch.randn(4, height // 8, width // 8, generator=generator),
            prompt_embeds=torch.randn(77, 16, generator=generator),
            pooled_prompt_embeds=torch.randn(8, generator=generator),
            row={
                "image_path": path,
                "image_sha256": "0" * 64,
                "caption": f"caption of {path}",
                "bucket_width": width,
                "bucket_height": height,
                "original_width": original[0],
                "original_height": original[1],
                "crop_top": crop[0],
                "crop_left": crop[1],
                "upscaled": False,
            },
        )

    first = [item("a.png", 96, 64, (300, 200), (0, 16), 0), item("b.png", 64, 96, (200, 300), (16, 0), 1)]
    ShardWriter(tmp_path / "c1", "w0").write(first)
    ShardWriter(tmp_path / "c2", "w0").write([item("c.png", 96, 64, (960, 640), (0, 0), 2)])
    for name, prefix in (("c1", ""), ("c2", "ohwx,")):
        settings = CacheSettings("model", "model", "fingerprint", 256, 512, 1, 0.13025, 77, caption_prefix=prefix, caption_suffix="")
        write_cache_info(tmp_path / name, settings)

    dataset = CachedDataset([tmp_path / "c1", tmp_path / "c2"])
    assert len(dataset) == 3
    assert [dataset.caption(index) for index in range(3)] == ["caption of a.png", "caption of b.png", "ohwx, caption of c.png"]
    assert list(dataset.image_paths) == ["a.png", "b.png", "c.png"]
    # add_time_ids order: original (h, w), crop (top, left), target (h, w).
    assert dataset.time_ids.tolist() == [[200, 300, 0, 16, 64, 96], [300, 200, 16, 0, 96, 64], [640, 960, 0, 0, 64, 96]]
    ids = dataset.bucket_ids()
    assert ids[0] == ids[2] != ids[1]

    sample = dataset[2]
    assert torch.equal(sample["latents"], torch.randn(4, 8, 12, generator=torch.Generator().manual_seed(2)).half())
    assert sample["time_ids"].tolist() == [640, 960, 0, 0, 64, 96]
    assert sample["sample_index"].item() == 2
    copy = dataset[2 + 2 * len(dataset)]  # item 2's third copy (--dataset_repeats): its tensors, its own sample index
    assert torch.equal(copy["latents"], sample["latents"]) and copy["sample_index"].item() == 8
    batch = collate([dataset[0], dataset[2]])
    assert batch["latents"].shape == (2, 4, 8, 12) and batch["time_ids"].shape == (2, 6)


def random_layout(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Bucket ids of a random dataset (buckets interleaved, some smaller than a global batch), its trainable
    items (some held out), a global batch (world size x per-rank batch) and an accumulation."""
    global_batch = int(rng.integers(1, 5)) * int(rng.integers(1, 4))
    sizes = rng.integers(1, 5 * global_batch, size=int(rng.integers(1, 7)))
    ids = rng.permutation(np.repeat(np.arange(len(sizes)), sizes)).astype(np.int64)
    trainable = np.flatnonzero(rng.random(len(ids)) > 0.1)
    return ids, trainable, global_batch, int(rng.integers(1, 6))


def test_fuzz_plans_carried_items_lead_the_next_epoch_and_nothing_is_lost():
    rng = np.random.default_rng(2026)
    for case in range(300):
        ids, trainable, global_batch, accumulation = random_layout(rng)
        planner = EpochPlanner(ids, trainable, global_batch, accumulation, seed=case)
        trainable_buckets, bucket_sizes = np.unique(ids[trainable], return_counts=True)
        batchable = set(trainable[np.isin(ids[trainable], trainable_buckets[bucket_sizes >= global_batch])].tolist())
        plans = planner.plans(4)
        context = f"buckets {np.bincount(ids).tolist()}, global batch {global_batch}, accumulation {accumulation}"
        for plan in plans:
            used = used_items(plan)
            assert len(used) == len(set(used)), context
            assert sorted(used + plan.carried_out.tolist()) == sorted(trainable.tolist()), context
            # Every item of a bucket that can form a batch is trained in every epoch but for its bucket's remainder.
            assert len(batchable - set(used)) <= sum(
                int(np.sum(ids[trainable] == bucket)) % global_batch for bucket in trainable_buckets
            ), context
        for previous, current in zip(plans, plans[1:]):
            waiting = [int(item) for item in previous.carried_out if int(item) in batchable]
            trained = set(used_items(current))
            missing = [item for item in waiting if item not in trained]
            assert not missing, f"items {missing} carried out of an epoch not trained in the next: {context}"
            # ... and trained first: the batches holding them lead the epoch.
            holds_waiting = [bool(np.isin(batch, waiting).any()) for batch in current.batches]
            assert holds_waiting == sorted(holds_waiting, reverse=True), context


def test_fuzz_a_resumed_epoch_trains_exactly_the_rest():
    rng = np.random.default_rng(7)
    for case in range(200):
        ids, trainable, global_batch, accumulation = random_layout(rng)
        planner = EpochPlanner(ids, trainable, global_batch, accumulation, seed=case)
        straight = planner.plans(3)
        if len(straight[1].batches) == 0:
            continue
        stop_after = int(rng.integers(0, straight[1].num_updates + 1))
        consumed = [batch for update in range(stop_after) for batch in straight[1].update_batches(update)]
        consumed = np.concatenate(consumed) if consumed else np.zeros(0, dtype=np.int64)
        resumed = planner.plans(3, start_epoch=1, carried_in=straight[0].carried_out, consumed=consumed)
        remaining = straight[1].batches[sum(len(straight[1].update_batches(u)) for u in range(stop_after)) :]
        assert [batch.tolist() for batch in resumed[0].batches] == [batch.tolist() for batch in remaining]
        assert np.array_equal(resumed[0].carried_out, straight[1].carried_out)
        assert [batch.tolist() for batch in resumed[1].batches] == [batch.tolist() for batch in straight[2].batches]


class SampleIndices(torch.utils.data.Dataset):
    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        return {"sample_index": torch.tensor(sample)}


def streamed(planner: EpochPlanner, global_batch: int, position, max_updates: int) -> tuple[list[list[int]], list[bool], object]:
    """The samples of each update a DataStream gives with --max_train_updates' cap (1 rank), whether each ends
    its epoch, and the position after the last one."""
    stream = DataStream(SampleIndices(), planner, position, 99, 0, global_batch, 0, torch.device("cpu"), max_updates)
    updates = list(stream)
    return [torch.cat([batch["sample_index"] for batch in update.microbatches]).tolist() for update in updates], [u.ends_epoch for u in updates], stream.position


class Tensors(torch.utils.data.Dataset):
    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        return {"sample_index": torch.tensor(sample), "latents": torch.zeros(2)}


def test_fuzz_the_stream_counts_its_epochs_without_planning_them_and_gives_the_positions_of_the_whole_plans():
    """DataStream plans one epoch at a time and counts the run's updates up front (by bucket sizes with whole
    repeats): the counts are those of the plans, and each update's position (what a checkpoint saves) is
    the one the whole plans give: the epoch's carried-in items and its batches so far. Sample indices stay on
    the host (no device read for the per-sample generators); the other tensors move to the device."""
    rng = np.random.default_rng(5)
    for case in range(60):
        ids, trainable, global_batch, accumulation = random_layout(rng)
        repeats = rng.choice([1.0, 2.0, 1.5, 0.5], size=len(ids)) if case % 3 == 0 else None
        planner = EpochPlanner(ids, trainable, global_batch, accumulation, seed=case, repeats=repeats)
        num_epochs = int(rng.integers(1, 5))
        max_updates = int(rng.integers(1, 12)) if case % 2 else None
        start = DataPosition.epoch_start(0)
        if case % 4 == 1:  # a resume inside epoch 1
            first, second = planner.plans(2)
            done = int(rng.integers(0, second.num_updates + 1))
            consumed = second.batches_through(done - 1).reshape(-1) if done else np.zeros(0, dtype=np.int64)
            start = DataPosition(1, done, first.carried_out, consumed)
        plans = planner.plans(num_epochs, start.epoch, start.carried_in, start.consumed, max_updates)
        stream = DataStream(Tensors(), planner, start, num_epochs, 0, global_batch, 0, torch.device("meta"), max_updates)
        assert stream.updates_per_epoch == [plan.num_updates for plan in plans], f"case {case}"
        expected = [(index, plan, update) for index, plan in enumerate(plans) for update in range(plan.num_updates)][:max_updates]
        updates = list(stream)
        assert len(updates) == len(expected) == stream.num_updates
        for update, (index, plan, update_in_plan) in zip(updates, expected):
            epoch = start.epoch + index
            carried_in, consumed = (start.carried_in, start.consumed) if index == 0 else (plans[index - 1].carried_out, np.zeros(0, dtype=np.int64))
            samples = torch.cat([batch["sample_index"] for batch in update.microbatches])
            assert samples.tolist() == plan.update_batches(update_in_plan).reshape(-1).tolist()
            assert all(batch["sample_index"].device.type == "cpu" and batch["latents"].device.type == "meta" for batch in update.microbatches)
            position = update.position_after
            if update.ends_epoch:
                assert (position.epoch, position.updates_in_epoch, position.consumed.tolist()) == (epoch + 1, 0, [])
                assert position.carried_in.tolist() == plan.carried_out.tolist()
            else:
                assert (position.epoch, position.carried_in.tolist()) == (epoch, carried_in.tolist())
                whole = np.concatenate([consumed, *plan.batches[: (update_in_plan + 1) * accumulation]])
                assert position.consumed.dtype == np.int64 and position.consumed.tolist() == whole.tolist()
                assert position.updates_in_epoch == (start.updates_in_epoch if index == 0 else 0) + update_in_plan + 1


def test_fuzz_a_run_capped_in_updates_stops_inside_an_epoch_and_a_resume_goes_on_exactly():
    """--max_train_updates: a run of `first` updates, resumed to `total`, trains the same samples in the same
    updates as a straight run of `total`, also when the cap falls inside an epoch."""
    rng = np.random.default_rng(11)
    checked = 0
    for case in range(120):
        ids, trainable, global_batch, accumulation = random_layout(rng)
        planner = EpochPlanner(ids, trainable, global_batch, accumulation, seed=case)
        per_epoch = planner.plan(0, np.zeros(0, dtype=np.int64)).num_updates
        if per_epoch == 0:
            plans = planner.plans(99, max_updates=5)  # no epoch can hold an update: planning stops
            assert len(plans) == 1 and len(plans[0].batches) == 0
            continue
        total = int(rng.integers(1, 3 * per_epoch + 2))
        first = int(rng.integers(0, total + 1))
        start = DataPosition.epoch_start(0)
        straight, straight_ends, _ = streamed(planner, global_batch, start, total)
        assert len(straight) == total
        head, _, position = streamed(planner, global_batch, start, first)
        rest, rest_ends, _ = streamed(planner, global_batch, position, total - first)
        assert head + rest == straight, f"case {case}: {first} + {total - first} updates differ from {total} straight"
        assert rest_ends == straight_ends[first:]
        checked += 1
    assert checked > 60


# --- repeats (--dataset_repeats) ---------------------------------------------------------------------------


def copies_per_item(samples, num_items: int) -> Counter:
    return Counter((np.asarray(samples) % num_items).tolist())


def test_whole_repeats_plan_every_copy_once_an_epoch():
    """Items 0-5 (repeat 1) and 6-9 (repeat 3) in two buckets, global batch 1: nothing is carried, so each
    epoch trains item i exactly its repeats, as samples i, i + 10, i + 20."""
    ids = np.array([0, 1] * 5, dtype=np.int64)
    repeats = np.array([1.0] * 6 + [3.0] * 4)
    planner = EpochPlanner(ids, np.arange(10), 1, 1, seed=4, repeats=repeats)
    for plan in planner.plans(3):
        used = used_items(plan)
        assert len(used) == len(set(used)) == 6 + 3 * 4
        assert copies_per_item(used, 10) == {**{item: 1 for item in range(6)}, **{item: 3 for item in range(6, 10)}}
        assert {sample for sample in used if sample >= 10} == {item + copy * 10 for item in range(6, 10) for copy in (1, 2)}
        assert all(len({ids[sample % 10] for sample in batch}) == 1 for batch in plan.batches)  # one bucket per batch


def test_fractional_repeats_take_that_share_of_items_anew_each_epoch():
    ids = np.zeros(20, dtype=np.int64)
    repeats = np.array([0.5] * 10 + [2.3] * 10)
    planner = EpochPlanner(ids, np.arange(20), 1, 1, seed=8, repeats=repeats)
    halves = []
    for epoch in range(4):
        counts = copies_per_item(planner.epoch_samples(epoch), 20)
        halves.append(frozenset(item for item in range(10) if counts[item]))
        assert len(halves[-1]) == 5 and all(counts[item] == 1 for item in halves[-1])  # exactly half of the first cache
        assert sorted(counts[item] for item in range(10, 20)) == [2] * 7 + [3] * 3  # 0.3 of ten items get a third copy
    assert len(set(halves)) > 1, "the same half was chosen in every epoch"
    again = EpochPlanner(ids, np.arange(20), 1, 1, seed=8, repeats=repeats)
    assert np.array_equal(again.epoch_samples(2), planner.epoch_samples(2))


def test_repeats_leave_held_out_items_out_and_one_is_the_plain_plan():
    ids = bucket_ids_for([7, 5])
    trainable = np.array([0, 1, 2, 4, 5, 7, 8, 9, 10])
    repeated = EpochPlanner(ids, trainable, 2, 1, seed=3, repeats=np.full(12, 2.0))
    assert set(copies_per_item(repeated.epoch_samples(0), 12)) == set(trainable.tolist())
    ones = EpochPlanner(ids, trainable, 2, 1, seed=3, repeats=np.ones(12))
    plain = EpochPlanner(ids, trainable, 2, 1, seed=3)
    assert [batch.tolist() for plan in ones.plans(2) for batch in plan.batches] == [batch.tolist() for plan in plain.plans(2) for batch in plan.batches]


def test_copies_of_an_item_get_their_own_noise_and_caption():
    from sdxl_trainer.training.captions import CaptionVariation, StepCaptionEncoder
    from sdxl_trainer.training.noise_settings import NoiseSettings
    from sdxl_trainer.training.sample_draws import draw_sample_randomness

    latents = torch.zeros(2, 4, 8, 8)
    copies = draw_sample_randomness(latents, torch.tensor([3, 3 + 10]), 5, 0, NoiseSettings(0.1))
    assert not torch.equal(copies.noise[0], copies.noise[1])
    captions = ["a, b"] * 3 + ["tag1, tag2, tag3, tag4, tag5, tag6"] + ["c"] * 6
    encoder = StepCaptionEncoder((None, None), captions, CaptionVariation(shuffle_tags=True), 5, 1, torch.device("cpu"))
    first, second = encoder.draws.captions_for([3, 13], epoch=0)
    assert sorted(first.split(", ")) == sorted(second.split(", ")) == sorted(captions[3].split(", ")) and first != second


@pytest.mark.parametrize(
    "repeats,message",
    [
        (["1"], "--dataset_repeats needs one number per --cached_dataset_dirs entry (2), got 1"),
        (["1", "0"], "--dataset_repeats must be > 0 and finite (leave a cache out instead of 0), got [1.0, 0.0]"),
    ],
)
def test_dataset_repeats_are_checked(repeats, message, capsys):
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "a", "b", "--dataset_repeats", *repeats])
    assert message in capsys.readouterr().err


def test_a_resume_with_other_repeats_plans_the_rest_of_the_epoch_anew():
    """Saved after 2 of 4 batches without repeats, resumed with every item repeated twice: the rest of the
    epoch holds every sample not yet trained, each once."""
    ids = np.zeros(8, dtype=np.int64)
    saved_plan = EpochPlanner(ids, np.arange(8), 2, 1, seed=1).plans(1)[0]
    consumed = np.concatenate(saved_plan.batches[:2])
    resumed = EpochPlanner(ids, np.arange(8), 2, 1, seed=1, repeats=np.full(8, 2.0)).plans(1, consumed=consumed)[0]
    assert sorted(used_items(resumed) + consumed.tolist()) == list(range(16))


# --- what the dataset holds per item ---------------------------------------------------------------------------


def objects_held(root: object) -> int:
    """How many Python objects `root` holds, directly or through others (classes, modules and functions left out)."""
    import gc
    import types

    seen, stack = set(), [root]
    while stack:
        held = stack.pop()
        if id(held) in seen or isinstance(held, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        seen.add(id(held))
        stack.extend(gc.get_referents(held))
    return len(seen)


def test_the_dataset_holds_no_python_object_per_item_and_reads_each_items_text_back(tmp_path):
    """Four Python lists of strings (shard, caption, image path, image hash) cost some 0.5 GiB per million items on
    every rank, and each DataLoader worker copied the pages it touched. Ten times the items in as many manifest
    parts: no more Python objects; every item's text still reads back as its manifest row has it."""
    from synthetic_manifest import write_manifest_cache

    from sdxl_trainer.cache.errors import CacheError
    from sdxl_trainer.cache.format import MANIFEST_DIR
    from sdxl_trainer.cache.reader import load_manifest

    small = CachedDataset([write_manifest_cache(tmp_path / "small", 2_000, rows_per_part=1_000, caption_length=60)])
    large = CachedDataset([write_manifest_cache(tmp_path / "large", 20_000, rows_per_part=10_000, caption_length=60)])
    assert (len(small), len(large)) == (2_000, 20_000)
    assert objects_held(large) - objects_held(small) == 0
    in_memory = CachedDataset([tmp_path / "small"], captions_in_memory=True)  # caption mode: every step reads captions
    assert objects_held(CachedDataset([tmp_path / "large"], captions_in_memory=True)) - objects_held(in_memory) == 0

    rows = load_manifest(tmp_path / "small").to_pylist()
    for dataset in (small, in_memory):
        assert [dataset.image_paths[item] for item in range(len(rows))] == [row["image_path"] for row in rows]
        assert [dataset.image_sha256[item] for item in range(len(rows))] == [row["image_sha256"] for row in rows]
        assert [dataset.shard[item] for item in range(len(rows))] == [row["shard"] for row in rows]
        assert dataset.index_in_shard.tolist() == [row["index_in_shard"] for row in rows]
        assert [dataset.caption_texts[item] for item in (0, 1_999, 1_000, 999, -1)] == [rows[item]["caption"] for item in (0, 1_999, 1_000, 999, -1)]
        assert len(dataset.caption_texts[5]) == 60 and dataset.captions()[7] == rows[7]["caption"]
        assert dataset.bucket_sizes.tolist() == [[row["bucket_width"], row["bucket_height"]] for row in rows]
    assert large.caption_texts[19_999] == "caption 19999".ljust(60).replace("  ", " w")
    # Captions outside caption mode are read from their manifest part when asked for: one gone since is named.
    (tmp_path / "large" / MANIFEST_DIR / "w0-000000.parquet").unlink()
    with pytest.raises(CacheError, match=r"manifest part .*large/manifest/w0-000000.parquet is gone since the cache was opened. Run `"):
        large.caption_texts[4]


def test_image_hashes_that_are_not_sha256_hex_read_back_as_written(tmp_path):
    """The dataset keeps SHA-256 hex digests as their bytes; a part holding anything else keeps every hash as text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from synthetic_manifest import write_manifest_cache

    from sdxl_trainer.cache.format import MANIFEST_DIR
    from sdxl_trainer.cache.reader import load_manifest

    cache = write_manifest_cache(tmp_path / "cache", 20, rows_per_part=10)
    second = tmp_path / "cache" / MANIFEST_DIR / "w0-000001.parquet"
    table = pq.read_table(second)
    odd = pa.array([f"MD5:{index:028X}" for index in range(len(table))])
    pq.write_table(table.set_column(table.schema.get_field_index("image_sha256"), "image_sha256", odd).replace_schema_metadata(table.schema.metadata), second)
    dataset = CachedDataset([cache])
    assert [dataset.image_sha256[item] for item in range(20)] == [row["image_sha256"] for row in load_manifest(cache).to_pylist()]
    assert dataset.image_sha256[15] == f"MD5:{5:028X}" and dataset.image_sha256[3] == "3".rjust(64, "0")


# ---- one cache once, what a plan holds, the data a checkpoint trained on -------------------------------------


def test_a_cache_named_twice_is_refused_however_it_is_written(tmp_path, capsys):
    """The same cache in two records (the same path, a trailing /, a symlink, an s3:// URL written another way) was
    accepted: the validation split then held an item out under one record and trained it under the other."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig

    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "link").symlink_to(cache)
    for first, second in ((cache, cache), (cache, f"{cache}/"), (cache, tmp_path / "link"), ("s3://bucket/caches/a", "s3://bucket//caches/a/")):
        identity = str(cache) if first == cache else "s3://bucket/caches/a"
        toml = tmp_path / "config.toml"
        toml.write_text(f'[[datasets]]\ncache_dir = "{first}"\n[[datasets]]\ncache_dir = "{second}"\nrepeats = 2\n')
        with pytest.raises(SystemExit):
            parse_config(TrainConfig, ["--config", str(toml)])
        assert (f"[[datasets]] number 2 ({second}) names the same cache as [[datasets]] number 1 ({first}): {identity}. Give each cache once "
                "(its validation items would be held out under one and trained under the other); for its items more often, repeats = N in its table"
                ) in capsys.readouterr().err
        with pytest.raises(SystemExit):
            parse_config(TrainConfig, ["--cached_dataset_dirs", str(first), str(tmp_path / "other"), str(second)])
        assert (f"--cached_dataset_dirs entry 3 ({second}) names the same cache as --cached_dataset_dirs entry 1 ({first}): {identity}. Give each cache "
                "once") in capsys.readouterr().err
    assert parse_config(TrainConfig, ["--cached_dataset_dirs", str(cache), "s3://bucket/caches/a", "s3://bucket/caches/b"]).cache_dirs()


def test_repeats_or_a_run_length_beyond_what_the_plan_holds_are_refused_before_anything_is_planned(tmp_path, capsys):
    """repeats = 1e9 printed nothing while every rank allocated gigabytes for the plan. An epoch holds at most
    MAX_EPOCH_SAMPLES samples and a run at most MAX_EPOCHS epochs; more is refused naming the cache or flag,
    before the plan (or anything of its size) is made."""
    import tracemalloc

    from synthetic_manifest import write_manifest_cache

    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.training.epochs import MAX_EPOCH_SAMPLES, MAX_EPOCHS
    from sdxl_trainer.training.training_data import load_training_data

    cache = write_manifest_cache(tmp_path / "cache", 700)  # 7 buckets of 100 items: 350 updates an epoch of global batch 2
    flags = ["--cached_dataset_dirs", str(cache), "--no-validation_loss", "--no-validation_image"]
    for extra, message in (
        (["--dataset_repeats", "1e9"], f"Cannot start training: an epoch would hold 700,000,000,000 samples, more than the {MAX_EPOCH_SAMPLES:,} a "
                                       "plan holds (every rank plans each epoch whole); the largest part is cache number 1: 700 items x repeats "
                                       "1e+09. Lower its repeats (repeats in its [[datasets]] table, or --dataset_repeats)"),
        (["--max_train_updates", "1000000000000"], f"Cannot start training: --max_train_updates 1,000,000,000,000 takes 2,857,142,858 epochs of "
                                                   f"350 updates, more than the {MAX_EPOCHS:,} epochs a run plans: lower --max_train_updates"),
    ):
        settings = parse_config(TrainConfig, [*flags, *extra]).data_settings()
        tracemalloc.start()
        try:
            with pytest.raises(SystemExit) as refused:
                load_training_data(settings, tmp_path / "run", seed=0, world_size=2, is_main=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(refused.value).startswith(message), str(refused.value)
        assert peak < 50e6, peak  # nothing of the plan's size was made
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, [*flags, "--num_train_epochs", "10000000"])
    assert f"--num_train_epochs 10,000,000 is more than the {MAX_EPOCHS:,} epochs a run plans: lower it" in capsys.readouterr().err


def test_a_checkpoint_records_its_data_and_a_resume_on_other_data_is_refused_naming_what_changed_and_the_flag(tmp_path, capsys):
    """A resume on other data (other items, or the same in another order) went on without a word when validation
    loss was off (the split file was the only check), its data position naming other items. The trainer state
    records the items and their order; a resume on anything else is refused, saying what changed and naming
    --accept_changed_dataset; a checkpoint from before the record is resumed as before."""
    import dataclasses

    import pyarrow.parquet as pq
    from synthetic_manifest import write_manifest_cache
    from unet_batches import trainer_state_for

    from sdxl_trainer.cache.format import MANIFEST_DIR
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.state.checkpointer import changed_dataset_problem
    from sdxl_trainer.state.trainer_state import TrainerState
    from sdxl_trainer.training.training_data import load_training_data

    first, second = write_manifest_cache(tmp_path / "first", 20, rows_per_part=10), write_manifest_cache(tmp_path / "second", 30)

    def identity(*caches: Path):
        settings = parse_config(TrainConfig, ["--cached_dataset_dirs", *map(str, caches), "--no-validation_loss", "--no-validation_image"]).data_settings()
        return load_training_data(settings, tmp_path / "run", seed=0, world_size=1, is_main=False).identity

    trained = identity(first)
    assert identity(first) == trained and trained.items == 20
    assert trained.changes(identity(first, second)) == "20 items then, 50 now"
    assert identity(first, second).changes(identity(second, first)) == "50 items then and now, but not the same ones (or the caches are listed in another order)"
    for part in sorted((first / MANIFEST_DIR).glob("*.parquet")):  # the same rows, each part's in reverse
        table = pq.read_table(part)
        pq.write_table(table.take(list(reversed(range(len(table))))).replace_schema_metadata(table.schema.metadata), part)
    reordered = identity(first)
    assert reordered.fingerprint == trained.fingerprint
    assert trained.changes(reordered) == "the same 20 items, in another order (a cache's manifest was written anew)"

    saved = TrainerState.from_json(dataclasses.replace(trainer_state_for(**trained.as_fields()), epoch=1).to_json(), tmp_path / "trainer_state.json")
    assert saved.dataset == trained
    problem = changed_dataset_problem(tmp_path / "update_00000003", saved, reordered, accepted=False)
    assert problem.startswith(
        f"{tmp_path / 'update_00000003'} was saved training on other data (the same 20 items, in another order (a cache's manifest was written anew))."
    ), problem
    assert "pass --accept_changed_dataset to go on with these: epoch 2 then starts over on them" in problem
    assert changed_dataset_problem(tmp_path, saved, reordered, accepted=True) == ""
    assert changed_dataset_problem(tmp_path, saved, trained, accepted=False) == ""
    older = TrainerState.from_json(trainer_state_for().to_json().replace('  "dataset_items": 0,\n  "dataset_fingerprint": "",\n  "dataset_order": "",\n', ""), tmp_path)
    assert older.dataset is None and changed_dataset_problem(tmp_path, older, reordered, accepted=False) == ""
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", str(first), "--accept_changed_dataset"])
    assert "--accept_changed_dataset only applies with --load_saved_state" in capsys.readouterr().err
