"""Which items are held out of training for validation, chosen once per run and kept in the run folder.

Choice (a pure function of the items and a seed, so every rank computes the same without communicating):
  - One seeded priority order over all items, stratified by bucket: each bucket's items are shuffled and
    item k of a bucket of n gets the position (k + 0.5) / n; all items are then sorted by that position.
    Any prefix of this order takes from every bucket in proportion to its size, so validation sees every
    shape the model trains on, and no bucket loses more than its share (a small bucket is not emptied).
  - The validation-loss set is the first `round(loss_percent x items)` items of that order, the
    validation-image set the first `round(image_percent x items)` (each optionally capped). So the two sets
    are nested, not disjoint: both only need items the model never trained on, and every held-out item is
    training data lost, so the run holds out max(loss share, image share), not their sum. The smaller set
    being inside the larger one does not bias either measure: they measure different things (denoising
    error at fixed noise, and the quality of whole generated images).
  - Held-out items are removed from the trainable items given to the epoch planner, so they never reach
    a training batch.

Persistence: the split is written to RUN_DIR/validation_split.json with each held-out item named by its
cache (position in --cached_dataset_dirs), image path and image content hash, and a fingerprint of the
whole dataset. A resumed run reads the file instead of choosing again, so the validation curves stay
comparable and no held-out item leaks into training. If the dataset or the split settings differ from the
file's, the run stops with the reason: train in a new run folder, or delete the file to choose a new split
(its validation curves then start over).
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sdxl_trainer.training.dataset import hex_text

HOLDOUT_FILE = "validation_split.json"
FORMAT_VERSION = 1
_HOLDOUT_STREAM = 0x0DD5EED  # separates the holdout's random stream from every other use of the run seed


class HoldoutError(RuntimeError):
    """The saved split does not fit this run; the message says what differs and what to do."""


@dataclass(frozen=True)
class SplitSettings:
    """How many items to hold out: shares 0-1 of all items (0 = none), caps in items (0 = no cap)."""

    loss_percent: float  # --validation_loss_percent
    image_percent: float  # --validation_image_percent
    max_loss_items: int = 0  # --max_validation_loss_items
    max_image_items: int = 0  # --max_validation_images


SETTING_FLAGS = dict(
    loss_percent="--validation_loss_percent",
    image_percent="--validation_image_percent",
    max_loss_items="--max_validation_loss_items",
    max_image_items="--max_validation_images",
)


@dataclass(frozen=True)
class Holdout:
    seed: int  # the seed the split was drawn with; validation noise and image seeds derive from it too
    loss_items: np.ndarray  # sorted dataset indices of the validation-loss items
    image_items: np.ndarray  # sorted dataset indices of the validation-image items

    @property
    def held_out(self) -> np.ndarray:
        return np.union1d(self.loss_items, self.image_items)

    def trainable(self, num_items: int) -> np.ndarray:
        """All dataset indices except the held-out ones: the `trainable` array for EpochPlanner."""
        return np.setdiff1d(np.arange(num_items, dtype=np.int64), self.held_out, assume_unique=True)


class ItemKeys(Sequence[str]):
    """Each item's name, "<cache position>/<image content hash>/<image path>": one that survives moving the cache
    and re-merging its manifest. Kept as its three parts in columns (positions in numpy, the hex hashes as text
    or as their bytes, the paths in Arrow) and ordered, fingerprinted and searched with Arrow's kernels: as a
    list of Python strings, ten million names took gigabytes on every rank. Sorting the columns (the position as text, then the
    hash, then the path) orders the names as sorting the joined strings does, since a '/' sorts below every
    digit and every hex letter (and a hash's bytes sort as its hex text does)."""

    FINGERPRINT_ROWS = 1 << 18  # names joined into text at a time

    def __init__(self, cache_index: np.ndarray, digests: pa.Array | pa.ChunkedArray, paths: pa.Array | pa.ChunkedArray):
        self.cache_index, self.digests, self.paths = np.asarray(cache_index), digests, paths
        self._fingerprints: dict[bool, str] = {}  # fingerprint(in_place), made once

    @classmethod
    def of(cls, names: ItemKeys | Sequence[str]) -> ItemKeys:
        """`names` as ItemKeys: a sequence of joined names is split into its columns."""
        if isinstance(names, ItemKeys):
            return names
        parts = [name.split("/", 2) for name in names]
        return cls(np.array([int(cache) for cache, _, _ in parts], dtype=np.int64), pa.array([digest for _, digest, _ in parts], pa.string()),
                   pa.array([path for _, _, path in parts], pa.string()))

    def __len__(self) -> int:
        return len(self.cache_index)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[position] for position in range(len(self))[index]]
        index = operator.index(index)
        digest = self.digests[index].as_py()
        return f"{int(self.cache_index[index])}/{digest.hex() if isinstance(digest, bytes) else digest}/{self.paths[index].as_py()}"

    @functools.cached_property
    def order(self) -> np.ndarray:
        """Item indices in the order of their names (independent of the manifest's order)."""
        caches, position = np.unique(self.cache_index, return_inverse=True)
        as_text = np.argsort(np.argsort([str(cache) for cache in caches.tolist()], kind="stable")) if len(caches) else np.zeros(0, dtype=np.int64)
        columns = pa.table({"cache": pa.array(as_text[position].astype(np.int32)), "digest": self.digests, "path": self.paths})
        return pc.sort_indices(columns, sort_keys=[("cache", "ascending"), ("digest", "ascending"), ("path", "ascending")]).to_numpy().astype(np.int64)

    def fingerprint(self, in_place: bool = False) -> str:
        """SHA-256 of every name and a newline, in name order: the same for the same items in any manifest order;
        with `in_place`, in the data's order: the same only for the same items in the same places."""
        if in_place in self._fingerprints:
            return self._fingerprints[in_place]
        digest = hashlib.sha256()
        rows = np.arange(len(self), dtype=np.int64) if in_place else self.order
        for start in range(0, len(self), self.FINGERPRINT_ROWS):
            chosen = rows[start:start + self.FINGERPRINT_ROWS]
            columns = (pa.array(self.cache_index[chosen]).cast(pa.string()), hex_text(self.digests.take(chosen)), self.paths.take(chosen))
            names = pc.binary_join_element_wise(*(column.cast(pa.large_string()) for column in columns), pa.scalar("/", pa.large_string()))
            digest.update("".join(f"{name}\n" for name in names.to_pylist()).encode("utf-8"))
        self._fingerprints[in_place] = digest.hexdigest()
        return self._fingerprints[in_place]

    def find(self, names: list[str]) -> np.ndarray:
        """The sorted indices of the items named in `names` (a name found nowhere adds none)."""
        wanted = set(names)
        paths = pa.array(sorted({name.split("/", 2)[2] for name in wanted if name.count("/") >= 2}), pa.string())
        candidates = np.flatnonzero(pc.is_in(self.paths, value_set=paths).to_numpy(zero_copy_only=False))  # the same path in other caches too
        return np.array([index for index in candidates.tolist() if self[index] in wanted], dtype=np.int64)


def item_keys(cache_index: np.ndarray, image_paths: Sequence[str], image_sha256: Sequence[str]) -> ItemKeys:
    """The names of items given by their cache positions, image paths and image content hashes (hex)."""
    return ItemKeys(cache_index, pa.array(list(image_sha256), pa.string()), pa.array(list(image_paths), pa.string()))


def dataset_item_keys(dataset) -> ItemKeys:
    """The names of a CachedDataset's items, from its columns (no string per item is made)."""
    return ItemKeys(dataset.cache_index, dataset.image_sha256.arrow(), dataset.image_paths.arrow())


def held_out_count(share: float, num_items: int, cap: int = 0) -> int:
    """round(share x items), at least 1 when share > 0, at most cap (0 = no cap), always leaving one item to train on."""
    if share <= 0 or num_items < 2:
        return 0
    count = max(1, round(share * num_items))
    if cap > 0:
        count = min(count, cap)
    return min(count, num_items - 1)


def priority_order(keys: ItemKeys | Sequence[str], bucket_ids: np.ndarray, seed: int) -> np.ndarray:
    """All item indices, stratified by bucket (see the module docstring); the same for the same keys and seed."""
    rng = np.random.default_rng([seed, _HOLDOUT_STREAM])
    by_key = ItemKeys.of(keys).order  # independent of manifest order
    positions = np.empty(len(keys), dtype=np.float64)
    for bucket in np.unique(bucket_ids):
        members = by_key[bucket_ids[by_key] == bucket]
        shuffled = members[rng.permutation(len(members))]
        positions[shuffled] = (np.arange(len(members)) + 0.5) / len(members)
    tie_break = np.empty(len(keys), dtype=np.float64)
    tie_break[by_key] = rng.random(len(keys))
    return np.lexsort((tie_break, positions))


def choose_holdout(keys: ItemKeys | Sequence[str], bucket_ids: np.ndarray, settings: SplitSettings, seed: int) -> Holdout:
    """Choose the validation-loss and validation-image items (nested prefixes of one stratified order)."""
    keys = ItemKeys.of(keys)
    order = priority_order(keys, bucket_ids, seed)
    num_loss = held_out_count(settings.loss_percent, len(keys), settings.max_loss_items)
    num_image = held_out_count(settings.image_percent, len(keys), settings.max_image_items)
    return Holdout(seed, np.sort(order[:num_loss]), np.sort(order[:num_image]))


def save_holdout(path: Path, holdout: Holdout, keys: ItemKeys | Sequence[str], settings: SplitSettings) -> None:
    keys = ItemKeys.of(keys)
    record = {
        "format_version": FORMAT_VERSION,
        "seed": holdout.seed,
        **asdict(settings),
        "num_items": len(keys),
        "dataset_fingerprint": keys.fingerprint(),
        "loss_items": [keys[index] for index in holdout.loss_items],
        "image_items": [keys[index] for index in holdout.image_items],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # readers on other ranks see the old state or the whole file, never half of it


def read_holdout(path: Path, keys: ItemKeys | Sequence[str], settings: SplitSettings) -> Holdout:
    """The saved split as dataset indices of this dataset, or a HoldoutError saying why it does not fit."""
    keys = ItemKeys.of(keys)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise HoldoutError(f"{path} is unreadable ({error}): delete it to choose a new validation split.") from error
    if record.get("format_version") != FORMAT_VERSION:
        raise HoldoutError(f"{path} has format {record.get('format_version')}, expected {FORMAT_VERSION}: delete it to choose a new split.")
    changed = [f"{SETTING_FLAGS[name]}: split {record.get(name)!r}, now {value!r}" for name, value in asdict(settings).items() if record.get(name) != value]
    if changed:
        raise HoldoutError(
            f"The validation split in {path} was made with other settings ({'; '.join(changed)}). Resume with the "
            f"split's settings, or delete {path} to choose a new split (validation curves then start over)."
        )
    if record["dataset_fingerprint"] != keys.fingerprint():
        saved = set(record["loss_items"]) | set(record["image_items"])
        missing = len(saved) - len(keys.find(list(saved)))
        raise HoldoutError(
            f"The dataset changed since the validation split in {path} was made ({record['num_items']} items then, "
            f"{len(keys)} now; {missing} held-out items no longer found as they were). Items trained on before could "
            f"become validation items, or held-out items training items. Train the new dataset in a new --project_name, "
            f"or delete {path} to choose a new split (validation curves then start over)."
        )
    return Holdout(int(record["seed"]), keys.find(record["loss_items"]), keys.find(record["image_items"]))


def load_or_choose_holdout(path: Path, keys: ItemKeys | Sequence[str], bucket_ids: np.ndarray, settings: SplitSettings, seed: int, write: bool = True) -> Holdout:
    """Read the run's split from `path` if it exists (a resumed run), else choose it and, if `write`
    (rank 0), save it. Every rank may call this: the choice is the same everywhere, and the file is
    replaced atomically, so a rank that reads it while rank 0 writes sees the whole of it."""
    keys = ItemKeys.of(keys)
    if path.exists():
        return read_holdout(path, keys, settings)
    holdout = choose_holdout(keys, bucket_ids, settings, seed)
    if write:
        save_holdout(path, holdout, keys, settings)
    return holdout
