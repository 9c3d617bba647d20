"""The latent + text-embedding cache: the contract between `sdxl_process_data_dir.py` and the trainer.

Layout of a cache folder (every path inside is relative, so the folder can be moved):

    cache_info.json              what produced the cache (model, VAE, resolution range, bucket table, ...)
    empty_prompt.safetensors     embeddings of the empty caption, for conditional dropout
    shards/<worker>-<seq>.safetensors     tensors of up to --items_per_shard items
    manifest/<worker>-<seq>.parquet       one row per item of the shard of the same name
    logs/                        one error log per worker run
    locks/<worker>.lock          held (flock) by the process caching as that worker, released when it ends
    damaged/                     shards (and their manifest parts) a re-run found damaged, kept for inspection

Each worker (one per GPU, or per machine) writes only files named after itself, so several writers
never touch the same file; cache_info.json and empty_prompt.safetensors are created once, by whichever
worker comes first (an exclusive create), and only read by the others. A shard is written to a temporary
name and renamed; its manifest part is written (also atomically) only afterwards and records the shard's
SHA-256 and size, so a manifest part is the commit record: a shard without one is an unfinished write and
is ignored. Each part also records the SHA-256 of cache_info.json and empty_prompt.safetensors as its worker
found them, so --verify checks those two files too. Readers merge all parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .buckets import LATENT_DOWNSCALE
from .files import LockHeld, ProcessLock, make_shareable

CACHE_FORMAT_VERSION = 1
CACHE_INFO_FILE = "cache_info.json"
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
# Manifest-part metadata keys of the SHA-256 of the files every worker shares (parts written by earlier
# versions hold none: --verify then only checks that the files read).
SHARED_FILE_CHECKSUM_KEYS = {CACHE_INFO_FILE: "cache_info_sha256", EMPTY_PROMPT_FILE: "empty_prompt_sha256"}
SHARD_DIR = "shards"
MANIFEST_DIR = "manifest"
LOG_DIR = "logs"
DAMAGED_DIR = "damaged"
LOCK_DIR = "locks"
STALE_TMP_S = 60.0  # a temporary file older than this was left by a killed worker
TENSOR_KEYS = ("latents", "prompt_embeds", "pooled_prompt_embeds")
FLIPPED_KEY = "latents_flipped"  # in caches made with --flip_aug
LOSS_MASK_KEY = "loss_mask"  # (1, h, w) at latent size, for the items whose manifest row says has_loss_mask
VERIFY_COMMAND = "python sdxl_process_data_dir.py --verify --cache_dir {cache_dir}"
# Stored precision of latents and embeddings: half the disk of fp32, and what the UNet consumes anyway.
STORAGE_DTYPE = torch.float16

MANIFEST_SCHEMA = pa.schema(
    [
        ("image_path", pa.string()),  # relative to the data folder, '/'-separated
        ("image_sha256", pa.string()),  # of the image file's bytes
        ("caption", pa.string()),  # the caption file's text: one caption per line (captions_in)
        ("bucket_width", pa.int32()),
        ("bucket_height", pa.int32()),
        ("original_width", pa.int32()),  # size of the source image, upright (after EXIF rotation)
        ("original_height", pa.int32()),
        ("crop_top", pa.int32()),  # crop offset in resized-image pixels (SDXL micro-conditioning)
        ("crop_left", pa.int32()),
        # The mirrored crop's left offset in the mirrored resized image (resized width - bucket width - crop_left):
        # the flipped latents' micro-conditioning. Null in parts written before it existed.
        ("crop_left_flipped", pa.int32()),
        ("upscaled", pa.bool_()),
        ("has_loss_mask", pa.bool_()),  # a loss mask is cached (LOSS_MASK_KEY); null in parts written before masks
        ("mask_sha256", pa.string()),  # of the mask file's bytes (--mask_files), so an edited mask is re-cached; else null
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
    # Upscaling (None / 0 = off): the target category and the weights' content hashes, so a cache made with
    # another upscaler or face restorer is told apart even when the file has the same name.
    upscale_to_resolution: int | None = None
    upscaler_sha256: str | None = None
    face_restorer_sha256: str | None = None
    # Text around every caption of this cache (--caption_prefix/--caption_suffix, e.g. a trigger word): in the
    # cached embeddings, and added by the trainer's caption mode after tag shuffling and dropout.
    caption_prefix: str = ""
    caption_suffix: str = ""
    # --flip_aug: each item's mirrored crop is encoded too (latents_flipped), for the trainer's --flip_aug.
    flip_aug: bool = False
    # Where loss masks came from (--mask_files: name.mask.png beside the image; --alpha_mask: its transparency).
    mask_files: bool = False
    alpha_mask: bool = False
    format_version: int = CACHE_FORMAT_VERSION

    def framed(self, caption: str) -> str:
        return framed_caption(caption, self.caption_prefix, self.caption_suffix)


def framed_caption(caption: str, prefix: str, suffix: str) -> str:
    """"prefix caption suffix", joined by single spaces as kohya's caption_prefix/caption_suffix (an empty part
    adds none)."""
    return " ".join(part for part in (prefix, caption, suffix) if part)


def captions_in(text: str) -> list[str]:
    """The captions a manifest caption holds, one per line of the caption file (whitespace collapsed, empty
    lines dropped). The cached embeddings encode the first; the trainer's caption mode chooses among all."""
    return text.split("\n")


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


def _create_once(tmp_path: Path, final_path: Path) -> bool:
    """Publish tmp_path as final_path unless final_path exists (atomic, also on NFS: a hard link fails
    if the name is taken). Returns whether this call created it; the temporary file is removed either way."""
    try:
        with open(tmp_path, "rb+") as handle:
            os.fsync(handle.fileno())
        os.link(tmp_path, final_path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp_path.unlink(missing_ok=True)


def _remove_stale_tmp(final_path: Path) -> None:
    """Temporary files of `final_path` that a killed worker left (a live writer renames its own within a second)."""
    for tmp in final_path.parent.glob(f".{final_path.name}.*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except FileNotFoundError:
            pass


def write_cache_info(cache_dir: Path, settings: CacheSettings) -> None:
    """Record the settings, or check them against an existing cache's (refusing to mix settings)."""
    path = cache_dir / CACHE_INFO_FILE
    _remove_stale_tmp(path)
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_name(path)
        tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
        if _create_once(tmp, path):
            return
    differences = settings_differences(read_cache_info(cache_dir), settings)
    if differences:
        raise CacheError(
            f"{cache_dir} was made with other settings ({'; '.join(differences)}). Its items would not match "
            "the new ones, so nothing was written: choose a new --cache_dir, or delete this one to rebuild it."
        )


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
    """Written once: every worker computes the same tensors (same settings), so the first one keeps them."""
    path = cache_dir / EMPTY_PROMPT_FILE
    _remove_stale_tmp(path)
    if path.exists():
        return
    tmp = _tmp_name(path)
    try:
        save_file(
            {
                "prompt_embeds": prompt_embeds.to(STORAGE_DTYPE).contiguous(),
                "pooled_prompt_embeds": pooled_prompt_embeds.to(STORAGE_DTYPE).contiguous(),
            },
            tmp,
        )
        make_shareable(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _create_once(tmp, path)


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
    latents_flipped: torch.Tensor | None = None  # the mirrored crop's latents, with --flip_aug
    loss_mask: torch.Tensor | None = None  # (1, h, w) in [0, 1] at latent size, for an item with a mask


class WorkerLock(ProcessLock):
    """One process per worker name and cache folder: a second one started by mistake would redo all the work
    and race on the same files. A ProcessLock on locks/<worker>.lock."""

    def __init__(self, cache_dir: Path, worker_name: str):
        try:
            super().__init__(cache_dir / LOCK_DIR / f"{worker_name}.lock")
        except LockHeld as held:
            raise CacheError(
                f"{held} is already caching worker {worker_name} into {cache_dir}: wait for it to finish, or give this "
                "process another --shard_index / --num_shards"
            ) from None


class ShardWriter:
    """Writes one worker's shards and manifest parts. `worker_name` must be unique among writers."""

    def __init__(self, cache_dir: Path, worker_name: str):
        self.cache_dir = cache_dir
        self.worker_name = worker_name
        (cache_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (cache_dir / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
        existing = [int(p.stem.rsplit("-", 1)[1]) for p in (cache_dir / MANIFEST_DIR).glob(f"{worker_name}-*.parquet")]
        self.next_seq = max(existing, default=-1) + 1
        # The cache script writes both shared files before any shard, and they never change afterwards.
        self.shared_file_checksums = {
            key: sha256_file(cache_dir / name) for name, key in SHARED_FILE_CHECKSUM_KEYS.items() if (cache_dir / name).exists()
        }
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Delete what a killed run of this same worker left unfinished: temporary files and shards without a
        manifest part. Only this worker writes files with its name, so nothing of another worker is touched."""
        committed = {p.stem for p in (self.cache_dir / MANIFEST_DIR).glob(f"{self.worker_name}-*.parquet")}
        for folder in (self.cache_dir / SHARD_DIR, self.cache_dir / MANIFEST_DIR):
            for path in folder.glob(f".{self.worker_name}-*.tmp"):
                path.unlink(missing_ok=True)
        for path in (self.cache_dir / SHARD_DIR).glob(f"{self.worker_name}-*.safetensors"):
            if path.stem not in committed:
                path.unlink(missing_ok=True)

    def write(self, items: list[CachedItem]) -> Path:
        """Write `items` as one shard + manifest part; returns the manifest part's path.

        On any OSError (a full disk above all) the temporary file is removed and the error re-raised:
        what was committed before stays valid, and nothing half-written is left under a final name."""
        name = f"{self.worker_name}-{self.next_seq:06d}"
        shard_path = self.cache_dir / SHARD_DIR / f"{name}.safetensors"
        tensors = {}
        for index, item in enumerate(items):
            for key in TENSOR_KEYS:
                tensors[f"{index}/{key}"] = getattr(item, key).to(STORAGE_DTYPE).contiguous()
            if item.latents_flipped is not None:
                tensors[f"{index}/{FLIPPED_KEY}"] = item.latents_flipped.to(STORAGE_DTYPE).contiguous()
            if item.loss_mask is not None:
                tensors[f"{index}/{LOSS_MASK_KEY}"] = item.loss_mask.to(STORAGE_DTYPE).contiguous()
        tmp = _tmp_name(shard_path)
        try:
            save_file(tensors, tmp)
            make_shareable(tmp)
            shard_sha256 = sha256_file(tmp)
            _atomic_replace(tmp, shard_path)
        finally:
            tmp.unlink(missing_ok=True)

        rows = [dict(item.row, shard=shard_path.name, index_in_shard=index) for index, item in enumerate(items)]
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).replace_schema_metadata(
            {
                "shard": shard_path.name,
                "shard_sha256": shard_sha256,
                "shard_bytes": str(shard_path.stat().st_size),
                "written_at_ns": str(time.time_ns()),
                **self.shared_file_checksums,
            }
        )
        part_path = self.cache_dir / MANIFEST_DIR / f"{name}.parquet"
        tmp = _tmp_name(part_path)
        try:
            pq.write_table(table, tmp)
            _atomic_replace(tmp, part_path)
        finally:
            tmp.unlink(missing_ok=True)
        self.next_seq += 1
        return part_path


@dataclass(frozen=True)
class ManifestPart:
    """One committed shard: its manifest part file and what the part records about the shard."""

    path: Path  # the .parquet file
    shard: str  # file name inside shards/
    shard_sha256: str
    shard_bytes: int
    written_at_ns: int
    num_rows: int
    shared_file_sha256: dict[str, str]  # file name -> SHA-256 (SHARED_FILE_CHECKSUM_KEYS); empty in older caches


def _read_part(path: Path) -> tuple[ManifestPart, pa.Table]:
    handle = pq.ParquetFile(path)
    metadata = handle.schema_arrow.metadata or {}
    table = handle.read(use_threads=False)  # parts are small: the parallelism is across parts
    if not table.schema.equals(MANIFEST_SCHEMA):
        for name in ("crop_left_flipped", "has_loss_mask", "mask_sha256"):  # a part from before flipped latents or masks
            if name not in table.column_names:
                table = table.append_column(name, pa.nulls(len(table), MANIFEST_SCHEMA.field(name).type))
        table = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    part = ManifestPart(
        path=path,
        shard=metadata[b"shard"].decode(),
        shard_sha256=metadata[b"shard_sha256"].decode(),
        shard_bytes=int(metadata[b"shard_bytes"]),
        written_at_ns=int(metadata[b"written_at_ns"]),
        num_rows=len(table),
        shared_file_sha256={name: metadata[key.encode()].decode() for name, key in SHARED_FILE_CHECKSUM_KEYS.items() if key.encode() in metadata},
    )
    return part, table


def read_manifest_parts(cache_dir: Path) -> tuple[list[tuple[ManifestPart, pa.Table]], dict[Path, str]]:
    """Every manifest part in write order, and the unreadable ones (path -> reason).

    Parts are read in parallel threads (Parquet decoding releases the GIL): a million items in a few
    thousand parts load in seconds."""
    part_paths = sorted((cache_dir / MANIFEST_DIR).glob("*.parquet"))
    parts, damaged = [], {}

    def read(path: Path):
        try:
            return _read_part(path)
        except (OSError, KeyError, ValueError, pa.ArrowException) as error:
            return f"unreadable manifest part ({type(error).__name__}: {error})"

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        for path, result in zip(part_paths, pool.map(read, part_paths)):
            if isinstance(result, str):
                damaged[path] = result
            else:
                parts.append(result)
    parts.sort(key=lambda item: (item[0].written_at_ns, item[0].path.name))
    return parts, damaged


def merge_parts(parts: list[tuple[ManifestPart, pa.Table]]) -> pa.Table:
    """Concatenate parts (in write order) keeping, for every image_path, only its last row."""
    if not parts:
        return MANIFEST_SCHEMA.empty_table()
    merged = pa.concat_tables([table for _, table in parts]).combine_chunks()
    if len(merged) == 0:
        return merged
    # Last occurrence per image_path, computed in Arrow (a Python dict over millions of rows is slow).
    order = pa.array(np.arange(len(merged), dtype=np.int64))
    last = merged.select(["image_path"]).append_column("row", order).group_by("image_path").aggregate([("row", "max")])
    keep = np.sort(last.column("row_max").to_numpy())
    if len(keep) == len(merged):
        return merged
    return merged.take(pa.array(keep))


def load_manifest(cache_dir: Path) -> pa.Table:
    """All manifest parts merged into one table. When an image was cached more than once (edited and
    re-cached), the row from the most recently written part wins. A damaged part is a CacheError."""
    parts, damaged = read_manifest_parts(cache_dir)
    if damaged:
        path, reason = next(iter(damaged.items()))
        raise CacheError(f"{path}: {reason}. {repair_advice(cache_dir)}")
    return merge_parts(parts)


def repair_advice(cache_dir: Path) -> str:
    return (
        f"Run `{VERIFY_COMMAND.format(cache_dir=cache_dir)}` to list the damage, then re-run the cache command "
        "(sdxl_process_data_dir.sh with the same flags) to re-encode the affected items."
    )


def shard_problem(cache_dir: Path, part: ManifestPart, full_checksum: bool = True) -> str | None:
    """Why `part`'s shard cannot be trusted (missing, wrong size, checksum mismatch), or None if it is intact.

    Without full_checksum only the size is compared: cheap enough for every file open of the trainer."""
    path = cache_dir / SHARD_DIR / part.shard
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != part.shard_bytes:
        return f"size {size} bytes, manifest says {part.shard_bytes}"
    if full_checksum and sha256_file(path) != part.shard_sha256:
        return "checksum mismatch (contents changed since it was written)"
    return None


def expected_shapes(row: dict, text_max_length: int) -> dict[str, tuple[int, ...]]:
    """Shapes (without the channel / width dimension) an item's tensors must have, from its manifest row."""
    return {
        "latents": (row["bucket_height"] // LATENT_DOWNSCALE, row["bucket_width"] // LATENT_DOWNSCALE),
        "prompt_embeds": (text_max_length,),
    }


def row_problems(shard, rows: list[dict], text_max_length: int, flip_aug: bool = False) -> list[str]:
    """Manifest rows checked against the open shard: every tensor present (the flipped latents too in a
    --flip_aug cache, the loss mask of a row with has_loss_mask), latents and mask matching the bucket."""
    problems = []
    present = set(shard.keys())
    for row in rows:
        label = f"item {row['index_in_shard']} ({row['image_path']})"
        latent_keys = ("latents", FLIPPED_KEY) if flip_aug else ("latents",)
        spatial_keys = (*latent_keys, LOSS_MASK_KEY) if row.get("has_loss_mask") else latent_keys
        missing = [key for key in dict.fromkeys((*TENSOR_KEYS, *spatial_keys)) if f"{row['index_in_shard']}/{key}" not in present]
        if missing:
            problems.append(f"{label}: tensors {missing} missing")
            continue
        shapes = expected_shapes(row, text_max_length)
        for key in spatial_keys:
            latents = tuple(shard.get_slice(f"{row['index_in_shard']}/{key}").get_shape())
            if latents[1:] != shapes["latents"]:
                problems.append(f"{label}: {key} {latents} do not match bucket {row['bucket_width']}x{row['bucket_height']}")
        embeds = tuple(shard.get_slice(f"{row['index_in_shard']}/prompt_embeds").get_shape())
        if embeds[:1] != shapes["prompt_embeds"]:
            problems.append(f"{label}: prompt_embeds {embeds} are not {text_max_length} tokens long")
    return problems


def empty_prompt_problem(path: Path, text_max_length: int) -> str | None:
    """What is wrong with the empty caption's embeddings as far as they can be checked without a checksum:
    unreadable, other tensors, or another caption length than the cache's."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            if names != {"prompt_embeds", "pooled_prompt_embeds"}:
                return f"holds the tensors {sorted(names)}, not prompt_embeds and pooled_prompt_embeds"
            length = handle.get_slice("prompt_embeds").get_shape()[0]
    except Exception as error:  # safetensors raises its own error types for bad headers
        return f"unreadable ({error})"
    if length != text_max_length:
        return f"prompt_embeds are {length} tokens long, but {CACHE_INFO_FILE} says {text_max_length}"
    return None


def shared_file_checks(cache_dir: Path, parts: list[tuple[ManifestPart, pa.Table]], text_max_length: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """cache_info.json and empty_prompt.safetensors against the SHA-256 the manifest parts recorded.

    Returns (problems, notes) by file name. Where no part recorded a checksum (a cache written before they
    were kept, or one without items) a note says so and only what reads can be checked: cache_info.json
    parses (read_cache_info) and the empty prompt holds its two tensors at the cache's caption length."""
    problems: dict[str, list[str]] = {}
    notes: dict[str, str] = {}
    for name in SHARED_FILE_CHECKSUM_KEYS:
        path = cache_dir / name
        if not path.exists():
            problems[name] = ["missing"]
            continue
        recorded = [(part, part.shared_file_sha256[name]) for part, _ in parts if name in part.shared_file_sha256]
        if recorded:
            actual = sha256_file(path)
            differing = [part for part, digest in recorded if digest != actual]
            if differing:
                problems[name] = [
                    f"checksum mismatch (contents changed since {MANIFEST_DIR}/{differing[0].path.name} recorded it): delete it and re-run "
                    "the cache command with the same flags, which writes it again"
                ]
            continue
        notes[name] = (
            "no checksum recorded (no manifest part records one: the cache was written before they were kept, or holds no items), "
            "so only checked that it reads"
        )
        problem = empty_prompt_problem(path, text_max_length) if name == EMPTY_PROMPT_FILE else None
        if problem:
            problems[name] = [problem]
    return problems, notes


def verify_cache(cache_dir: Path) -> tuple[int, dict[str, list[str]], dict[str, str]]:
    """Check every shard against its checksum, every manifest row against its shard, and cache_info.json and
    empty_prompt.safetensors against theirs (shared_file_checks).

    Returns (items checked, problems by file name relative to cache_dir, notes by file name: what could not be
    checked). Reads every shard once."""
    settings = read_cache_info(cache_dir)
    parts, damaged_parts = read_manifest_parts(cache_dir)
    problems: dict[str, list[str]] = {f"{MANIFEST_DIR}/{path.name}": [reason] for path, reason in damaged_parts.items()}
    shared_problems, notes = shared_file_checks(cache_dir, parts, settings.text_max_length)
    problems.update(shared_problems)
    if not (cache_dir / MANIFEST_DIR).is_dir():
        problems[MANIFEST_DIR] = ["missing: the cache lists no items at all"]
    # A shard no manifest part lists: its part was lost (its items silently gone from the cache) or its write
    # was cut short. (Run --verify while no cache worker is writing: a shard is listed a moment after it is written.)
    listed = {part.shard for part, _ in parts}
    for shard in sorted((cache_dir / SHARD_DIR).glob("*.safetensors")):
        if shard.name not in listed:
            problems[f"{SHARD_DIR}/{shard.name}"] = ["no manifest part lists it: its items are missing from the cache"]
    checked = 0
    for part, table in parts:
        name = f"{SHARD_DIR}/{part.shard}"
        problem = shard_problem(cache_dir, part)
        if problem:
            problems[name] = [f"{problem} (listed in {MANIFEST_DIR}/{part.path.name})"]
            continue
        try:
            with safe_open(str(cache_dir / name), framework="pt") as shard:
                found = row_problems(shard, table.to_pylist(), settings.text_max_length, settings.flip_aug)
        except Exception as error:  # safetensors raises its own error types for bad headers
            found = [f"unreadable ({error})"]
        if found:
            problems[name] = found
        checked += part.num_rows
    return checked, problems, notes


def quarantine(cache_dir: Path, *paths: Path) -> None:
    """Move damaged files (a shard and its manifest part, or an unreadable part) into damaged/, so their rows
    no longer count and their items get re-encoded. Another worker may have moved them already: fine."""
    damaged_dir = cache_dir / DAMAGED_DIR
    damaged_dir.mkdir(exist_ok=True)
    for path in paths:
        try:
            os.replace(path, damaged_dir / path.name)
        except FileNotFoundError:
            pass


def part_files(cache_dir: Path, part: ManifestPart) -> tuple[Path, Path]:
    """The manifest part and the shard it commits."""
    return part.path, cache_dir / SHARD_DIR / part.shard


class CacheReader:
    """Reads items' tensors from shards, keeping a few shard files open (memory-mapped by safetensors).

    A shard whose size differs from the one its manifest part records (truncated, replaced, missing) is
    refused with a CacheError naming the file; run --verify for the full checksum check."""

    def __init__(self, cache_dir: Path, max_open_shards: int = 16):
        self.cache_dir = cache_dir
        self.max_open_shards = max_open_shards
        self._open_shards: OrderedDict[str, object] = OrderedDict()
        self._parts: dict[str, ManifestPart] | None = None

    def _part(self, shard_name: str) -> ManifestPart | None:
        if self._parts is None:  # read lazily: each DataLoader worker process reads its own copy
            self._parts = {part.shard: part for part, _ in read_manifest_parts(self.cache_dir)[0]}
        return self._parts.get(shard_name)

    def _shard(self, shard_name: str):
        handle = self._open_shards.get(shard_name)
        if handle is None:
            path = self.cache_dir / SHARD_DIR / shard_name
            part = self._part(shard_name)
            problem = "not listed in any manifest part" if part is None else shard_problem(self.cache_dir, part, full_checksum=False)
            if problem is None:
                try:
                    handle = safe_open(str(path), framework="pt")
                except Exception as error:  # safetensors raises its own error types for bad headers
                    problem = f"unreadable ({error})"
            if problem is not None:
                raise CacheError(f"cache shard {path} is damaged: {problem}. {repair_advice(self.cache_dir)}")
            self._open_shards[shard_name] = handle
            if len(self._open_shards) > self.max_open_shards:
                self._open_shards.popitem(last=False)
        else:
            self._open_shards.move_to_end(shard_name)
        return handle

    def read(self, shard_name: str, index_in_shard: int, keys: tuple[str, ...] = TENSOR_KEYS) -> dict[str, torch.Tensor]:
        shard = self._shard(shard_name)
        try:
            return {key: shard.get_tensor(f"{index_in_shard}/{key}") for key in keys}
        except Exception as error:
            raise CacheError(
                f"item {index_in_shard} of cache shard {self.cache_dir / SHARD_DIR / shard_name} is unreadable ({error}). "
                f"{repair_advice(self.cache_dir)}"
            ) from error
