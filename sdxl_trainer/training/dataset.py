"""The dataset of cached items from one or more caches: each sample's tensors, micro-conditioning, loss
weight and (with --flip_aug) the view drawn for it.
"""

from __future__ import annotations

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

from sdxl_trainer.cache.format import FLIPPED_KEY, LOSS_MASK_KEY, MANIFEST_SCHEMA, TENSOR_KEYS, CacheLocation, captions_in, read_cache_info
from sdxl_trainer.cache.reader import CacheReader, intact_parts, merge_parts, read_manifest_part
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
_PACK_ROWS = 1 << 20  # digests unpacked at a time (64 MiB of characters)


class HexDigests(Sequence[str]):
    """Lower-case hex digests of one length (the images' SHA-256), kept as their bytes: 32 bytes an item instead
    of 64 characters and an offset."""

    def __init__(self, packed: np.ndarray):
        self._packed = packed  # (items, digest bytes) uint8

    @classmethod
    def packed_from(cls, values: pa.ChunkedArray) -> HexDigests | None:
        """The digests of a text column, or None when it holds anything else (nulls, other lengths, upper case)."""
        lengths = pc.min_max(pc.binary_length(values)) if len(values) else None
        if values.null_count or lengths is None or lengths["min"] != lengths["max"] or lengths["min"].as_py() % 2:
            return None
        width = lengths["min"].as_py()
        packed = np.empty((len(values), width // 2), dtype=np.uint8)
        row = 0
        for chunk in values.chunks:
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32 if chunk.type == pa.string() else np.int64)
            characters = np.frombuffer(chunk.buffers()[2], dtype=np.uint8)[offsets[chunk.offset]:offsets[chunk.offset + len(chunk)]]
            for start in range(0, len(chunk), _PACK_ROWS):
                digits = _HEX_VALUES[characters[start * width:(start + _PACK_ROWS) * width]].reshape(-1, width)
                if (digits == 255).any():
                    return None
                packed[row:row + len(digits)] = digits[:, 0::2] << 4 | digits[:, 1::2]
                row += len(digits)
        return cls(packed)

    def __len__(self) -> int:
        return len(self._packed)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._packed[operator.index(index)].tobytes().hex()

    def arrow(self) -> pa.Array:
        """The digests' bytes, one fixed-size binary value per item (ordered as the hex text is), without a copy."""
        width = self._packed.shape[1]
        return pa.Array.from_buffers(pa.binary(width), len(self._packed), [None, pa.py_buffer(np.ascontiguousarray(self._packed))])


def hex_text(digests: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Digests as lower-case hex text: fixed-size binary values (HexDigests.arrow) converted, text as it is."""
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

    def __len__(self) -> int:
        return len(self._part)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        key = (int(self._cache_index[index]), int(self._part[index]))
        values = self._recent.get(key)
        if values is None:
            cache, part = key
            values = read_manifest_part(self._cache_dirs[cache], self._part_names[cache][part], [self._column]).column(0)
            self._recent[key] = values
            if len(self._recent) > self.KEPT_PARTS:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(key)
        return values[int(self._row[index])].as_py()


class CachedDataset(Dataset):
    """All items of the given caches. Item i's tensors are read from its shard on access. With
    `loss_weights` (one per cache, --dataset_loss_weights) each item also carries its cache's "loss_weight"; with
    `flip_aug` (caches made with --flip_aug) its mirrored view too, for choose_views; with `loss_masks`
    (--masked_loss) its "loss_mask" at latent size: the cached one, or ones (trained everywhere) for an item without.

    Per item it holds numbers in numpy arrays and text in Arrow (TextColumn, HexDigests), no Python object, so its
    memory is some 100 bytes an item plus the image paths' text, shared with the DataLoader workers. The captions,
    most of a manifest's bytes, are held only with `captions_in_memory` (caption mode encodes them at every step);
    otherwise an item's caption is read from its manifest part when asked for (PartColumn)."""

    def __init__(self, cache_dirs: list[CacheLocation], loss_weights: list[float] | None = None, flip_aug: bool = False, loss_masks: bool = False,
                 captions_in_memory: bool = False):
        self.flip_aug = flip_aug
        self.loss_masks = loss_masks
        self.cache_dirs = list(cache_dirs)
        self.loss_weights = None if loss_weights is None else [float(weight) for weight in loss_weights]
        self.cache_settings = [read_cache_info(cache_dir) for cache_dir in self.cache_dirs]  # each cache's caption prefix and suffix
        dropped = {"upscaled", "mask_sha256"} | (set() if captions_in_memory else {"caption"})
        columns = [name for name in MANIFEST_SCHEMA.names if name not in dropped]
        located = pa.schema([MANIFEST_SCHEMA.field(name) for name in columns] + [("part", pa.int32()), ("row", pa.int32()), ("cache_index", pa.int32())])
        tables = []
        self._shard_bytes = []  # per cache: shard name -> size, so the readers need not read the manifest again
        part_names = []  # per cache: its manifest parts, for the captions read on use
        for cache_index, cache_dir in enumerate(self.cache_dirs):
            parts = intact_parts(cache_dir, columns)
            self._shard_bytes.append({part.shard: part.shard_bytes for part, _ in parts})
            part_names.append([part.name for part, _ in parts])
            table = merge_parts([
                (part, table.append_column("part", pa.array(np.full(len(table), number, dtype=np.int32)))
                 .append_column("row", pa.array(np.arange(len(table), dtype=np.int32))))
                for number, (part, table) in enumerate(parts)
            ]) if parts else located.empty_table().drop_columns(["cache_index"])
            tables.append(table.append_column("cache_index", pa.array(np.full(len(table), cache_index, dtype=np.int32))))
        table = pa.concat_tables(tables) if tables else located.empty_table()
        del tables
        self.num_items = len(table)

        def column(name: str) -> np.ndarray:
            return table.column(name).to_numpy()

        self.cache_index = column("cache_index").astype(np.min_scalar_type(max(len(self.cache_dirs) - 1, 0)))
        self.shard = TextColumn(table.column("shard").dictionary_encode().combine_chunks())  # a shard's name once, a code per item
        self.index_in_shard = column("index_in_shard")
        self.image_paths = TextColumn(table.column("image_path"))  # relative to the data folder the cache was made from
        sha256 = table.column("image_sha256")  # of the source image's bytes
        self.image_sha256: Sequence[str] = HexDigests.packed_from(sha256) or TextColumn(sha256)
        if captions_in_memory:  # one caption per line (cache.captions_in)
            self.caption_texts: Sequence[str] = TextColumn(table.column("caption"))
        else:
            self.caption_texts = PartColumn("caption", self.cache_dirs, part_names, self.cache_index, column("part"), column("row"))
        # SDXL add_time_ids: original (h, w), crop (top, left), target (h, w).
        self.time_ids = np.stack(
            [column(name) for name in ("original_height", "original_width", "crop_top", "crop_left", "bucket_height", "bucket_width")],
            axis=1,
        ).astype(np.float32)
        self.has_loss_mask = pc.fill_null(table.column("has_loss_mask"), False).to_numpy(zero_copy_only=False)
        if flip_aug:
            self.crop_left_flipped = pc.coalesce(table.column("crop_left_flipped"), table.column("crop_left")).to_numpy().astype(np.float32)
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
        tensors["time_ids"] = torch.from_numpy(self.time_ids[index])
        if self.flip_aug:
            mirrored = self.time_ids[index].copy()
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
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._dataset.caption(index % len(self))


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
