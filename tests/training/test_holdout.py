"""The validation split: deterministic, stratified by bucket, nested, saved and reused, refused when the data
changed, and never planned into a training batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdxl_trainer.training.epochs import EpochPlanner
from sdxl_trainer.training.holdout import HOLDOUT_FILE, HoldoutError, SplitSettings, choose_holdout, held_out_count, item_keys, load_or_choose_holdout


def dataset(counts: list[int]) -> tuple[list[str], np.ndarray]:
    """Item keys and bucket ids for buckets of the given sizes."""
    bucket_ids = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    keys = item_keys(np.zeros(len(bucket_ids), dtype=np.int64), [f"img{i:04d}.png" for i in range(len(bucket_ids))], [f"{i:064x}" for i in range(len(bucket_ids))])
    return keys, bucket_ids


def test_same_split_from_the_same_items_and_seed_whatever_the_manifest_order():
    keys, buckets = dataset([40, 25, 10, 5])
    first = choose_holdout(keys, buckets, SplitSettings(0.1, 0.05), seed=7)
    again = choose_holdout(keys, buckets, SplitSettings(0.1, 0.05), seed=7)
    assert np.array_equal(first.loss_items, again.loss_items) and np.array_equal(first.image_items, again.image_items)
    # The same items listed in another order (another manifest merge order) give the same items.
    order = np.random.default_rng(0).permutation(len(keys))
    shuffled = choose_holdout([keys[i] for i in order], buckets[order], SplitSettings(0.1, 0.05), seed=7)
    assert sorted(keys[i] for i in first.loss_items) == sorted(keys[order[i]] for i in shuffled.loss_items)
    other_seed = choose_holdout(keys, buckets, SplitSettings(0.1, 0.05), seed=8)
    assert not np.array_equal(first.loss_items, other_seed.loss_items)


def test_counts_are_proportional_per_bucket_and_sets_are_nested():
    keys, buckets = dataset([400, 250, 100, 50])
    for seed in range(5):
        holdout = choose_holdout(keys, buckets, SplitSettings(0.10, 0.04), seed=seed)
        assert len(holdout.loss_items) == 80 and len(holdout.image_items) == 32
        per_bucket = np.bincount(buckets[holdout.loss_items], minlength=4)
        assert np.all(np.abs(per_bucket - np.array([40, 25, 10, 5])) <= 1), per_bucket
        assert set(holdout.image_items) <= set(holdout.loss_items)
        assert len(holdout.held_out) == 80


def test_held_out_count_rounds_caps_and_leaves_something_to_train():
    assert held_out_count(0.1, 30) == 3
    assert held_out_count(0.1, 4) == 1  # at least one when asked for
    assert held_out_count(0.0, 30) == 0
    assert held_out_count(0.1, 100_000, cap=500) == 500
    assert held_out_count(0.9, 2) == 1
    assert held_out_count(0.5, 1) == 0


def test_split_is_saved_and_reused_and_a_changed_dataset_is_refused(tmp_path):
    keys, buckets = dataset([30, 20])
    path = tmp_path / HOLDOUT_FILE
    first = load_or_choose_holdout(path, keys, buckets, SplitSettings(0.1, 0.1), seed=1)
    record = json.loads(path.read_text())
    assert record["loss_items"] == [keys[i] for i in first.loss_items]
    # Resume with another run seed: the saved split (and its seed) wins.
    resumed = load_or_choose_holdout(path, keys, buckets, SplitSettings(0.1, 0.1), seed=999)
    assert resumed.seed == 1 and np.array_equal(resumed.loss_items, first.loss_items)
    # The same items in another manifest order map back to the same items.
    reordered = load_or_choose_holdout(path, keys[::-1], buckets[::-1], SplitSettings(0.1, 0.1), seed=1)
    assert sorted(keys[::-1][i] for i in reordered.loss_items) == sorted(keys[i] for i in first.loss_items)
    with pytest.raises(HoldoutError, match="--validation_loss_percent"):
        load_or_choose_holdout(path, keys, buckets, SplitSettings(0.2, 0.1), seed=1)
    with pytest.raises(HoldoutError, match="dataset changed"):
        load_or_choose_holdout(path, list(keys) + ["0/ff/new.png"], np.append(buckets, 0), SplitSettings(0.1, 0.1), seed=1)
    edited = list(keys)
    edited[int(first.loss_items[0])] = edited[int(first.loss_items[0])].replace("/0000", "/eeee", 1)  # same path, new content
    with pytest.raises(HoldoutError, match="1 held-out items no longer found"):
        load_or_choose_holdout(path, edited, buckets, SplitSettings(0.1, 0.1), seed=1)


def test_only_rank_zero_writes(tmp_path):
    keys, buckets = dataset([10])
    load_or_choose_holdout(tmp_path / HOLDOUT_FILE, keys, buckets, SplitSettings(0.2, 0.2), seed=0, write=False)
    assert not (tmp_path / HOLDOUT_FILE).exists()


@pytest.mark.parametrize("global_batch,accumulation", [(2, 1), (3, 2), (4, 1)])
def test_held_out_items_never_appear_in_planned_batches(global_batch, accumulation):
    keys, buckets = dataset([23, 17, 9, 6])
    for seed in range(4):
        holdout = choose_holdout(keys, buckets, SplitSettings(0.15, 0.1), seed=seed)
        trainable = holdout.trainable(len(keys))
        assert len(trainable) + len(holdout.held_out) == len(keys)
        planner = EpochPlanner(buckets, trainable, global_batch, accumulation, seed)
        planned = {int(item) for plan in planner.plans(5) for batch in plan.batches for item in batch}
        assert planned, "the plan trains on something"
        assert not planned & set(holdout.held_out.tolist())


def test_item_names_are_ordered_fingerprinted_and_found_as_their_joined_strings_are():
    """ItemKeys keeps the names' parts in columns (digests as bytes, as CachedDataset holds them) and sorts those:
    the order, the fingerprint a saved split is checked against and the items found must be what the joined
    strings give, or a split saved before would no longer fit its own run (positions 10 and 11 sort before 2 as
    text; paths with spaces, accents and other scripts)."""
    import hashlib

    import pyarrow as pa

    from sdxl_trainer.training.dataset import packed_digests
    from sdxl_trainer.training.holdout import ItemKeys

    rng = np.random.default_rng(3)
    count = 500
    caches = rng.integers(0, 12, count)
    words = ["a", "b", "é", "日本", "a b", "z-1", "photo", "Photo"]
    paths = [f"{rng.choice(words)}/{rng.choice(words)}{i % 37}.jpg" for i in range(count)]
    digests = [f"{value:064x}" for value in rng.integers(0, 50, count)]  # repeated contents under other paths
    joined = [f"{cache}/{digest}/{path}" for cache, digest, path in zip(caches, digests, paths)]
    unique = sorted(set(range(count)), key=joined.__getitem__)
    unique = [index for position, index in enumerate(unique) if position == 0 or joined[index] != joined[unique[position - 1]]]
    caches, paths, digests, joined = caches[unique], [paths[i] for i in unique], [digests[i] for i in unique], [joined[i] for i in unique]
    packed = pa.chunked_array([packed_digests(pa.array(digests[:200])), packed_digests(pa.array(digests[200:]))])  # as a manifest's parts
    for keys in (ItemKeys(caches, packed, pa.chunked_array([pa.array(paths[:100]), pa.array(paths[100:])])), ItemKeys.of(joined)):
        assert list(keys) == joined
        assert [joined[i] for i in keys.order] == sorted(joined)
        assert keys.fingerprint() == hashlib.sha256("".join(f"{name}\n" for name in sorted(joined)).encode()).hexdigest()
        chosen = [joined[i] for i in (7, 3, 99)] + ["0/ff/not-there.png"]
        assert keys.find(chosen).tolist() == [3, 7, 99]
