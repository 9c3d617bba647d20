"""The dataset of cached items from one or more caches: each sample's tensors, micro-conditioning, loss
weight and (with --flip_aug) the view drawn for it.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from sdxl_trainer.cache.format import FLIPPED_KEY, LOSS_MASK_KEY, MANIFEST_SCHEMA, TENSOR_KEYS, CacheLocation, Store, captions_in, read_cache_info
from sdxl_trainer.cache.reader import CacheReader, intact_parts, merge_parts, read_manifest_part
from sdxl_trainer.cache.stores import open_store
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


class TextColumn(Sequence[str]):
    """One string per item, kept in Arrow (one buffer and its offsets, or a dictionary's codes) and made a str only
    when read. A Python str per item costs some 60 bytes of object besides its text on every rank (0.5 GiB per
    million items for the manifest's four text columns), and a forked DataLoader worker copies every page of such
    objects it touches (reading one writes its reference count); Arrow's buffers stay shared."""

    def __init__(self, values: pa.Array | pa.ChunkedArray):
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._values[operator.index(index)].as_py()

    def arrow(self) -> pa.Array | pa.ChunkedArray:
        return self._values


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_HEX_VALUES = np.full(256, 255, dtype=np.uint8)
_HEX_VALUES[_HEX_DIGITS] = np.arange(16, dtype=np.uint8)
DIGEST_BYTES = 32  # SHA-256


def packed_digests(text: pa.Array | pa.ChunkedArray) -> pa.Array | None:
    """SHA-256 hex digests (lower case) as their bytes, one fixed-size binary value each; None when the text
    holds anything else (a null, another length, another character)."""
    text = text.combine_chunks() if isinstance(text, pa.ChunkedArray) else text
    width = 2 * DIGEST_BYTES
    if text.null_count or (len(text) and pc.min_max(pc.binary_length(text)).as_py() != {"min": width, "max": width}):
        return None
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32 if text.type == pa.string() else np.int64)
    characters = np.frombuffer(text.buffers()[2], dtype=np.uint8)[offsets[text.offset]:offsets[text.offset + len(text)]] if len(text) else np.zeros(0, np.uint8)
    digits = _HEX_VALUES[characters].reshape(-1, width)
    if (digits == 255).any():
        return None
    packed = np.ascontiguousarray(digits[:, 0::2] << 4 | digits[:, 1::2])
    return pa.Array.from_buffers(pa.binary(DIGEST_BYTES), len(text), [None, pa.py_buffer(packed)])


def hex_text(digests: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Digests as lower-case hex text: fixed-size binary values (packed_digests) converted, text as it is."""
    if not pa.types.is_fixed_size_binary(digests.type):
        return digests
    if isinstance(digests, pa.ChunkedArray):
        return pa.chunked_array([hex_text(chunk) for chunk in digests.chunks], pa.large_string())
    width = digests.type.byte_width
    raw = np.frombuffer(digests.buffers()[1], dtype=np.uint8)[digests.offset * width:(digests.offset + len(digests)) * width].reshape(-1, width)
    text = np.empty((len(digests), 2 * width), dtype=np.uint8)
    text[:, 0::2], text[:, 1::2] = _HEX_DIGITS[raw >> 4], _HEX_DIGITS[raw & 15]
    offsets = np.arange(0, text.size + 1, 2 * width, dtype=np.int64)
    return pa.Array.from_buffers(pa.large_string(), len(digests), [None, pa.py_buffer(offsets), pa.py_buffer(text)])


class HexDigests(Sequence[str]):
    """Hex digests (the images' SHA-256) kept as their bytes in Arrow (packed_digests): 32 bytes an item instead of
    64 characters and an offset; read back as hex."""

    def __init__(self, values: pa.Array | pa.ChunkedArray):
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._values[operator.index(index)].as_py().hex()

    def arrow(self) -> pa.Array | pa.ChunkedArray:
        """The digests' bytes (fixed-size binary), which sort as their hex text does."""
        return self._values


def _position(index, length: int) -> int:
    """A sequence's index as a position in 0..length-1 (a negative one counts from the end), or IndexError."""
    index = operator.index(index)
    if not -length <= index < length:
        raise IndexError(index)
    return index % length


class PartColumn(Sequence[str]):
    """A text column read from each item's manifest part when an item's value is asked for (the last few parts
    kept): the captions outside caption mode, which only validation and sample prompts read, a handful of
    items, while they are most of the manifest's bytes."""

    KEPT_PARTS = 8

    def __init__(self, column: str, cache_dirs: list[CacheLocation], part_names: list[list[str]], cache_index: np.ndarray,
                 part: np.ndarray, row: np.ndarray):
        self._column, self._cache_dirs, self._part_names = column, cache_dirs, part_names
        self._cache_index, self._part, self._row = cache_index, part, row
        self._recent: OrderedDict[tuple[int, int], pa.ChunkedArray] = OrderedDict()
        self._stores: dict[int, Store] = {}  # opened on first use, in the process that reads (an S3 client is a session)

    def __len__(self) -> int:
        return len(self._part)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        index = _position(index, len(self))
        key = (int(self._cache_index[index]), int(self._part[index]))
        values = self._recent.get(key)
        if values is None:
            cache, part = key
            if cache not in self._stores:
                self._stores[cache] = open_store(self._cache_dirs[cache])
            values = read_manifest_part(self._stores[cache], self._part_names[cache][part]).column(self._column)
            self._recent[key] = values
            if len(self._recent) > self.KEPT_PARTS:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(key)
        return values[int(self._row[index])].as_py()


# The manifest columns the dataset reads (the captions too in caption mode).
KEPT_COLUMNS = ("image_path", "image_sha256", "shard", "index_in_shard", "bucket_width", "bucket_height", "original_width", "original_height",
                "crop_top", "crop_left", "crop_left_flipped", "has_loss_mask")


def compact_part(table: pa.Table, captions: bool) -> pa.Table:
    """A manifest part's rows as the dataset keeps them: the columns it reads, the image hashes as their bytes
    (packed_digests, where they are SHA-256 hex), each shard's name once (a dictionary: one for the part)."""
    kept = table.select([*KEPT_COLUMNS, "caption"] if captions else list(KEPT_COLUMNS))
    digests = packed_digests(kept.column("image_sha256"))
    if digests is not None:
        kept = kept.set_column(kept.schema.get_field_index("image_sha256"), "image_sha256", digests)
    return kept.set_column(kept.schema.get_field_index("shard"), "shard", kept.column("shard").dictionary_encode())


class CachedDataset(Dataset):
    """All items of the given caches. Item i's tensors are read from its shard on access. With
    `loss_weights` (one per cache, --dataset_loss_weights) each item also carries its cache's "loss_weight"; with
    `flip_aug` (caches made with --flip_aug) its mirrored view too, for choose_views; with `loss_masks`
    (--masked_loss) its "loss_mask" at latent size: the cached one, or ones (trained everywhere) for an item without.

    Per item it holds numbers in numpy arrays and text in Arrow (TextColumn, HexDigests), no Python object: about
    55 bytes an item plus its image path, shared with the DataLoader workers. The captions, most of a manifest's
    bytes, are held only with `captions_in_memory` (caption mode encodes them at every step); otherwise an item's
    caption is read from its manifest part when asked for (PartColumn). The manifest parts are compacted as they
    are read (compact_part) and become the columns' chunks without a copy."""

    def __init__(self, cache_dirs: list[CacheLocation], loss_weights: list[float] | None = None, flip_aug: bool = False, loss_masks: bool = False,
                 captions_in_memory: bool = False):
        self.flip_aug = flip_aug
        self.loss_masks = loss_masks
        self.cache_dirs = list(cache_dirs)
        self.loss_weights = None if loss_weights is None else [float(weight) for weight in loss_weights]
        self.cache_settings = [read_cache_info(cache_dir) for cache_dir in self.cache_dirs]  # each cache's caption prefix and suffix
        compact = functools.partial(compact_part, captions=captions_in_memory)
        self._shard_bytes = []  # per cache: shard name -> size, so the readers need not read the manifest again
        part_names = []  # per cache: its manifest parts, for the captions read on use
        located = []  # per cache: its parts, each row with its part and its row in it
        for cache_dir in self.cache_dirs:
            parts = intact_parts(cache_dir, compact)
            self._shard_bytes.append({part.shard: part.shard_bytes for part, _ in parts})
            part_names.append([part.name for part, _ in parts])
            located.append([
                (part, table.append_column("part", pa.array(np.full(len(table), number, dtype=np.int32)))
                 .append_column("row", pa.array(np.arange(len(table), dtype=np.int32))))
                for number, (part, table) in enumerate(parts)
            ])
            del parts
        tables = []
        for cache_index, parts in enumerate(_same_hash_type(located)):
            if parts:
                merged = merge_parts(parts)
                tables.append(merged.append_column("cache_index", pa.array(np.full(len(merged), cache_index, dtype=np.int32))))
        del located
        table = pa.concat_tables(tables) if tables else _empty_table(compact)
        del tables
        self.num_items = len(table)

        def column(name: str, smallest: bool = False) -> np.ndarray:
            """The column in numpy; with `smallest`, in the narrowest unsigned type that holds its values."""
            values = table.column(name).to_numpy()
            return values.astype(np.min_scalar_type(int(values.max(initial=0)))) if smallest else values

        # Numbers into numpy, text into one buffer a column: then the parts' chunks are freed whole (freeing some of
        # their columns and keeping others would leave most of their pages held).
        self.cache_index = column("cache_index").astype(np.min_scalar_type(max(len(self.cache_dirs) - 1, 0)))
        self.index_in_shard = column("index_in_shard", smallest=True)
        # SDXL add_time_ids: original (h, w), crop (top, left), target (h, w), in pixels: held in the narrowest
        # unsigned type that holds them all (16 bits up to 65,535 px), made float32 per item; filled a column at a time.
        names = ("original_height", "original_width", "crop_top", "crop_left", "bucket_height", "bucket_width")
        largest = max((int(pc.max(table.column(name)).as_py() or 0) for name in names), default=0)
        self.time_ids = np.empty((self.num_items, 6), dtype=np.min_scalar_type(largest))
        for position, name in enumerate(names):
            self.time_ids[:, position] = column(name)
        self.has_loss_mask = pc.fill_null(table.column("has_loss_mask"), False).to_numpy(zero_copy_only=False)
        if flip_aug:
            self.crop_left_flipped = pc.coalesce(table.column("crop_left_flipped"), table.column("crop_left")).to_numpy().astype(np.float32)
        if captions_in_memory:  # one caption per line (cache.captions_in)
            self.caption_texts: Sequence[str] = TextColumn(_one_buffer(table.column("caption")))
        else:
            self.caption_texts = PartColumn("caption", self.cache_dirs, part_names, self.cache_index, column("part", True), column("row", True))
        self.shard = TextColumn(_one_buffer(table.select(["shard"]).unify_dictionaries().column(0)))  # each name once, a code per item
        self.image_paths = TextColumn(_one_buffer(table.column("image_path")))  # relative to the data folder the cache was made from
        sha256 = _one_buffer(table.column("image_sha256"))  # of the source image's bytes
        self.image_sha256: Sequence[str] = HexDigests(sha256) if pa.types.is_fixed_size_binary(sha256.type) else TextColumn(sha256)
        self._readers: dict[int, CacheReader] = {}

    @property
    def bucket_sizes(self) -> np.ndarray:
        """Every item's bucket (width, height), (items, 2) int32, made from the micro-conditioning on each call (not
        held twice); bucket_size for one item."""
        return self.time_ids[:, [5, 4]].astype(np.int32)

    def bucket_size(self, index: int) -> tuple[int, int]:
        """Item `index`'s bucket (width, height)."""
        return int(self.time_ids[index, 5]), int(self.time_ids[index, 4])

    def __len__(self) -> int:
        return self.num_items

    def caption(self, index: int) -> str:
        """Item `index`'s first caption with its cache's prefix and suffix: what its cached embeddings encode."""
        return self.framed(index, captions_in(self.caption_texts[index])[0])

    def captions(self) -> Sequence[str]:
        """Every item's caption() as a sequence, each read when asked for (not a list of them all)."""
        return FramedCaptions(self)

    def framed(self, index: int, caption: str) -> str:
        """`caption` (one of item `index`'s, as written or varied) with the item's cache's prefix and suffix."""
        return self.cache_settings[int(self.cache_index[index])].framed(caption)

    def bucket_ids(self) -> np.ndarray:
        """One integer per item naming its bucket (equal sizes = equal id)."""
        return self.time_ids[:, 5].astype(np.int64) * 100_000 + self.time_ids[:, 4].astype(np.int64)

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
        tensors["time_ids"] = torch.from_numpy(self.time_ids[index].astype(np.float32))
        if self.flip_aug:
            mirrored = self.time_ids[index].astype(np.float32)
            mirrored[3] = self.crop_left_flipped[index]  # add_time_ids' crop left (see choose_views)
            tensors["time_ids_flipped"] = torch.from_numpy(mirrored)
        tensors["sample_index"] = torch.tensor(sample, dtype=torch.int64)
        if self.loss_weights is not None:
            tensors["loss_weight"] = torch.tensor(self.loss_weights[int(self.cache_index[index])], dtype=torch.float32)
        return tensors


class FramedCaptions(Sequence[str]):
    """CachedDataset.caption of each item, read when asked for."""

    def __init__(self, dataset: CachedDataset):
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._dataset.caption(_position(index, len(self)))


def _same_hash_type(located: list[list[tuple]]) -> list[list[tuple]]:
    """The caches' parts (compacted), their image hashes all packed or, where some part's are not SHA-256 hex, all
    text again, so the parts concatenate."""
    if len({table.schema.field("image_sha256").type for parts in located for _, table in parts}) <= 1:
        return located

    def as_text(table: pa.Table) -> pa.Table:
        return table.set_column(table.schema.get_field_index("image_sha256"), "image_sha256", hex_text(table.column("image_sha256")).cast(pa.large_string()))

    return [[(part, as_text(table)) for part, table in parts] for parts in located]


def _one_buffer(column: pa.ChunkedArray) -> pa.Array:
    """A column's chunks copied into one array (text with 64-bit offsets where 32-bit ones would overflow)."""
    if (pa.types.is_string(column.type) or pa.types.is_binary(column.type)) and column.nbytes >= 2**31:
        column = column.cast(pa.large_binary() if pa.types.is_binary(column.type) else pa.large_string())
    return column.combine_chunks() if column.num_chunks else pa.array([], column.type)


def _empty_table(compact) -> pa.Table:
    """The table of a dataset without items (every cache empty), with the columns of one that has some."""
    empty = compact(MANIFEST_SCHEMA.empty_table())
    return empty.append_column("part", pa.array([], pa.int32())).append_column("row", pa.array([], pa.int32())).append_column(
        "cache_index", pa.array([], pa.int32()))


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
