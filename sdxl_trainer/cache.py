"""The latent + text-embedding cache: the contract between `sdxl_process_data_dir.py` and the trainer.

Layout of a cache folder (every path inside is relative, so the folder can be moved):

    cache_info.json              what produced the cache (model, VAE, resolution range, bucket table, ...)
    empty_prompt.safetensors     embeddings of the empty caption, for conditional dropout
    shards/<worker>-<seq>.safetensors     tensors of up to --items_per_shard items
    manifest/<worker>-<seq>.parquet       one row per item of the shard of the same name
    logs/                        one error log per worker run

Each worker (one per GPU, or per machine) writes only files named after itself, so several writers
never touch the same file. A shard is written to a temporary name and renamed; its manifest part is
written (also atomically) only afterwards and records the shard's SHA-256, so a manifest part is the
commit record: a shard without one is an unfinished write and is ignored. Readers merge all parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CACHE_FORMAT_VERSION = 1
CACHE_INFO_FILE = "cache_info.json"
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
SHARD_DIR = "shards"
MANIFEST_DIR = "manifest"
LOG_DIR = "logs"
# Stored precision of latents and embeddings: half the disk of fp32, and what the UNet consumes anyway.
STORAGE_DTYPE = torch.float16

MANIFEST_SCHEMA = pa.schema(
    [
        ("image_path", pa.string()),  # relative to the data folder, '/'-separated
        ("image_sha256", pa.string()),  # of the image file's bytes
        ("caption", pa.string()),
        ("bucket_width", pa.int32()),
        ("bucket_height", pa.int32()),
        ("original_width", pa.int32()),  # size of the source image, upright (after EXIF rotation)
        ("original_height", pa.int32()),
        ("crop_top", pa.int32()),  # crop offset in resized-image pixels (SDXL micro-conditioning)
        ("crop_left", pa.int32()),
        ("upscaled", pa.bool_()),
        ("shard", pa.string()),  # file name inside shards/
        ("index_in_shard", pa.int32()),
    ]
)


@dataclass(frozen=True)
class CacheSettings:
    """Everything that changes the cached tensors. The trainer compares these with its own settings."""

    pretrained_model_name_or_path: str
    vae_name_or_path: str
    model_fingerprint: str  # hash of the VAE and text-encoder configs: catches a different model family
    min_resolution: int
    max_resolution: int
    bucket_table_version: int
    latent_scaling_factor: float  # cached latents are VAE means multiplied by this
    text_max_length: int
    format_version: int = CACHE_FORMAT_VERSION


class CacheError(RuntimeError):
    """The cache is missing, damaged or was made with other settings; the message says what to do."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_replace(tmp_path: Path, final_path: Path) -> None:
    """fsync then rename, so a crash leaves either the old file, the new file, or a stray .tmp: never half."""
    with open(tmp_path, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp_path, final_path)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_cache_info(cache_dir: Path, settings: CacheSettings) -> None:
    """Record the settings, or check them against an existing cache's."""
    path = cache_dir / CACHE_INFO_FILE
    if path.exists():
        existing = read_cache_info(cache_dir)
        differences = settings_differences(existing, settings)
        if differences:
            raise CacheError(
                f"{cache_dir} was made with other settings ({'; '.join(differences)}). "
                "Choose a new --cache_dir, or delete this one to rebuild it."
            )
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
    _atomic_replace(tmp, path)


def read_cache_info(cache_dir: Path) -> CacheSettings:
    path = cache_dir / CACHE_INFO_FILE
    if not path.exists():
        raise CacheError(f"{path} not found: run sdxl_process_data_dir.py to build the cache first.")
    try:
        return CacheSettings(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as error:
        raise CacheError(f"{path} is damaged or from another version ({error}); rebuild the cache.") from error


def settings_differences(cached: CacheSettings, wanted: CacheSettings, fields: tuple[str, ...] | None = None) -> list[str]:
    """Human-readable list of the settings that differ, e.g. "max_resolution: cache 1024, now 768"."""
    cached_dict, wanted_dict = asdict(cached), asdict(wanted)
    names = fields if fields is not None else tuple(cached_dict)
    return [f"{name}: cache {cached_dict[name]!r}, now {wanted_dict[name]!r}" for name in names if cached_dict[name] != wanted_dict[name]]


def write_empty_prompt(cache_dir: Path, prompt_embeds: torch.Tensor, pooled_prompt_embeds: torch.Tensor) -> None:
    """Every worker computes the same tensors, so concurrent writers racing on the rename is harmless."""
    path = cache_dir / EMPTY_PROMPT_FILE
    tmp = _tmp_name(path)
    save_file(
        {
            "prompt_embeds": prompt_embeds.to(STORAGE_DTYPE).contiguous(),
            "pooled_prompt_embeds": pooled_prompt_embeds.to(STORAGE_DTYPE).contiguous(),
        },
        tmp,
    )
    _atomic_replace(tmp, path)


def read_empty_prompt(cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    path = cache_dir / EMPTY_PROMPT_FILE
    if not path.exists():
        raise CacheError(f"{path} not found: the cache is incomplete; re-run sdxl_process_data_dir.py.")
    tensors = load_file(path)
    return tensors["prompt_embeds"], tensors["pooled_prompt_embeds"]


@dataclass
class CachedItem:
    """Tensors of one item as the cache writer receives them (any float dtype; stored as fp16)."""

    latents: torch.Tensor  # (4, H/8, W/8), already multiplied by the VAE scaling factor
    prompt_embeds: torch.Tensor  # (77, 2048): penultimate hidden states of both text encoders
    pooled_prompt_embeds: torch.Tensor  # (1280,): pooled output of text encoder 2
    row: dict  # manifest fields except shard and index_in_shard


class ShardWriter:
    """Writes one worker's shards and manifest parts. `worker_name` must be unique among writers."""

    def __init__(self, cache_dir: Path, worker_name: str):
        self.cache_dir = cache_dir
        self.worker_name = worker_name
        (cache_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (cache_dir / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
        existing = [int(p.stem.rsplit("-", 1)[1]) for p in (cache_dir / MANIFEST_DIR).glob(f"{worker_name}-*.parquet")]
        self.next_seq = max(existing, default=-1) + 1

    def write(self, items: list[CachedItem]) -> Path:
        """Write `items` as one shard + manifest part; returns the manifest part's path."""
        name = f"{self.worker_name}-{self.next_seq:06d}"
        self.next_seq += 1
        shard_path = self.cache_dir / SHARD_DIR / f"{name}.safetensors"
        tensors = {}
        for index, item in enumerate(items):
            tensors[f"{index}/latents"] = item.latents.to(STORAGE_DTYPE).contiguous()
            tensors[f"{index}/prompt_embeds"] = item.prompt_embeds.to(STORAGE_DTYPE).contiguous()
            tensors[f"{index}/pooled_prompt_embeds"] = item.pooled_prompt_embeds.to(STORAGE_DTYPE).contiguous()
        tmp = _tmp_name(shard_path)
        save_file(tensors, tmp)
        shard_sha256 = sha256_file(tmp)
        _atomic_replace(tmp, shard_path)

        rows = [dict(item.row, shard=shard_path.name, index_in_shard=index) for index, item in enumerate(items)]
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).replace_schema_metadata(
            {
                "shard": shard_path.name,
                "shard_sha256": shard_sha256,
                "shard_bytes": str(shard_path.stat().st_size),
                "written_at_ns": str(time.time_ns()),
            }
        )
        part_path = self.cache_dir / MANIFEST_DIR / f"{name}.parquet"
        tmp = _tmp_name(part_path)
        pq.write_table(table, tmp)
        _atomic_replace(tmp, part_path)
        return part_path


def load_manifest(cache_dir: Path) -> pa.Table:
    """All manifest parts merged into one table. When an image was cached more than once (edited and
    re-cached), the row from the most recently written part wins."""
    part_paths = sorted((cache_dir / MANIFEST_DIR).glob("*.parquet"))
    if not part_paths:
        return MANIFEST_SCHEMA.empty_table()
    parts = []
    for path in part_paths:
        table = pq.read_table(path, schema=MANIFEST_SCHEMA)
        written_at = int(pq.read_schema(path).metadata[b"written_at_ns"])
        parts.append((written_at, path.name, table))
    parts.sort(key=lambda part: (part[0], part[1]))
    merged = pa.concat_tables([table for _, _, table in parts])
    if len(merged) == 0:
        return merged
    # Keep the last occurrence of every image_path (the parts are in write order).
    paths = merged.column("image_path").to_pylist()
    last_index = {path: index for index, path in enumerate(paths)}
    if len(last_index) == len(paths):
        return merged
    return merged.take(sorted(last_index.values()))


class CacheReader:
    """Reads items' tensors from shards, keeping a few shard files open (memory-mapped by safetensors)."""

    def __init__(self, cache_dir: Path, max_open_shards: int = 16):
        self.cache_dir = cache_dir
        self.max_open_shards = max_open_shards
        self._open_shards: OrderedDict[str, object] = OrderedDict()

    def _shard(self, shard_name: str):
        handle = self._open_shards.get(shard_name)
        if handle is None:
            path = self.cache_dir / SHARD_DIR / shard_name
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types for bad headers
                raise CacheError(f"cannot read cache shard {path} ({error}); re-run sdxl_process_data_dir.py to repair it.") from error
            self._open_shards[shard_name] = handle
            if len(self._open_shards) > self.max_open_shards:
                self._open_shards.popitem(last=False)
        else:
            self._open_shards.move_to_end(shard_name)
        return handle

    def read(self, shard_name: str, index_in_shard: int) -> dict[str, torch.Tensor]:
        shard = self._shard(shard_name)
        try:
            return {
                key: shard.get_tensor(f"{index_in_shard}/{key}")
                for key in ("latents", "prompt_embeds", "pooled_prompt_embeds")
            }
        except Exception as error:
            raise CacheError(
                f"item {index_in_shard} of cache shard {self.cache_dir / SHARD_DIR / shard_name} is unreadable ({error}); "
                "re-run sdxl_process_data_dir.py to repair the cache."
            ) from error
