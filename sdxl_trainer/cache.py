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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load, save_file

from .buckets import BUCKET_TABLE_VERSION, LATENT_DOWNSCALE
from .encoding import TEXT_MAX_LENGTH, TOKENS_PER_CHUNK, model_fingerprint
from .files import LockHeld, ProcessLock, make_shareable
from .single_file import is_single_file, model_location_problem
from .storage import (
    REMOTE_READ_THREADS,
    CacheError,
    LocalStore,
    LocalTensors,
    ObjectLease,
    RemoteStore,
    RemoteTensors,
    StorageError,
    open_store,
    sha256_file,
)

Store = LocalStore | RemoteStore
CacheLocation = str | Path | Store  # a folder, or an s3:// URL (storage.py)

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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_cache_info(cache_dir: CacheLocation, settings: CacheSettings) -> None:
    """Record the settings, or check them against an existing cache's (refusing to mix settings)."""
    store = open_store(cache_dir)
    store.remove_stale_staging(CACHE_INFO_FILE)
    if not store.exists(CACHE_INFO_FILE):
        store.make_folders("")
        staged = store.staging_path(CACHE_INFO_FILE)
        staged.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
        if store.publish_once(staged, CACHE_INFO_FILE):
            return
    differences = settings_differences(read_cache_info(store), settings)
    if differences:
        raise CacheError(
            f"{store} was made with other settings ({'; '.join(differences)}). Its items would not match "
            "the new ones, so nothing was written: choose a new --cache_dir, or delete this one to rebuild it."
        )


def read_cache_info(cache_dir: CacheLocation) -> CacheSettings:
    store = open_store(cache_dir)
    try:
        text = store.read_bytes(CACHE_INFO_FILE).decode("utf-8")
    except FileNotFoundError:
        raise CacheError(f"{store.location(CACHE_INFO_FILE)} not found: run sdxl_process_data_dir.py to build the cache first.") from None
    try:
        return CacheSettings(**json.loads(text))
    except (json.JSONDecodeError, TypeError) as error:
        raise CacheError(f"{store.location(CACHE_INFO_FILE)} is damaged or from another version ({error}); rebuild the cache.") from error


def settings_differences(cached: CacheSettings, wanted: CacheSettings, fields: tuple[str, ...] | None = None) -> list[str]:
    """Human-readable list of the settings that differ, e.g. "max_resolution: cache 1024, now 768"."""
    cached_dict, wanted_dict = asdict(cached), asdict(wanted)
    names = fields if fields is not None else tuple(cached_dict)
    return [f"{name}: cache {cached_dict[name]!r}, now {wanted_dict[name]!r}" for name in names if cached_dict[name] != wanted_dict[name]]


@dataclass(frozen=True)
class CacheRequirements:
    """What a training run asks of its caches; a None flag is taken from the caches (check_caches)."""

    pretrained_model_name_or_path: str | None
    single_file_config: str
    min_resolution: int | None
    max_resolution: int | None
    flip_aug: bool  # the run trains mirrored latents
    masked_loss: bool  # the run trains with loss masks


@dataclass(frozen=True)
class CacheCheck:
    """What check_caches found: the settings the caches supply (as the run's config fields), the problems,
    and what every later reader of the caches needs."""

    taken: dict[str, object]
    problems: list[str]
    vae_name_or_path: str | None = None  # the VAE the caches were encoded with, where it is not the model's own
    caption_chunks: int = 0  # the caches' caption length in chunks of 75 tokens


def cache_vae(info: CacheSettings) -> str | None:
    """The VAE a cache was encoded with, where it is not its model's own (--vae_name_or_path at caching)."""
    return None if info.vae_name_or_path == info.pretrained_model_name_or_path else info.vae_name_or_path


def check_caches(cache_dirs: list[CacheLocation], wanted: CacheRequirements) -> CacheCheck:
    """Every cache must exist and match the run's model family and bucket table, and all must share one VAE
    (the one validation decodes with and the export holds) and one caption length. What the requirements
    leave unset (model, resolution range) is taken from the caches. The model is compared by the
    fingerprint of its VAE and text-encoder configs (read from config files only), not by its path, so a
    moved or re-downloaded model still matches."""
    infos, problems = {}, []
    for cache_dir in cache_dirs:
        try:
            infos[cache_dir] = read_cache_info(cache_dir)
        except CacheError as error:
            problems.append(str(error))
    if problems:
        return CacheCheck({}, problems)
    taken, problems = _take_cache_settings(wanted, infos)
    model = taken.get("pretrained_model_name_or_path", wanted.pretrained_model_name_or_path)
    problems = problems or _model_problems(model, wanted.single_file_config)
    if problems:
        return CacheCheck(taken, problems)
    vaes, text_lengths = set(), set()
    for cache_dir, info in infos.items():
        vaes.add(cache_vae(info))
        text_lengths.add(info.text_max_length // TEXT_MAX_LENGTH * TOKENS_PER_CHUNK)
        expected = dict(bucket_table_version=BUCKET_TABLE_VERSION, model_fingerprint=model_fingerprint(model, cache_vae(info), wanted.single_file_config))
        differences = settings_differences(info, replace(info, **expected), tuple(expected))
        if differences:
            problems.append(f"{cache_dir} was made with other settings ({'; '.join(differences)}): re-cache it with this model")
    unflipped = [str(cache_dir) for cache_dir, info in infos.items() if not info.flip_aug]
    if wanted.flip_aug and unflipped:
        problems.append(
            f"--flip_aug trains the mirrored latents, which {', '.join(unflipped)} lack: re-cache with sdxl_process_data_dir.py --flip_aug "
            "(the cache goes on where it stands only with the settings it was made with, so into a new --cache_dir), or drop --flip_aug"
        )
    if wanted.masked_loss and not any(info.mask_files or info.alpha_mask for info in infos.values()):
        problems.append(
            "--masked_loss trains with the caches' loss masks, and none of the caches holds any: re-cache with sdxl_process_data_dir.py "
            "--mask_files (name.mask.png beside each image) or --alpha_mask (into a new --cache_dir), or drop --masked_loss"
        )
    if len(vaes) > 1:
        names = sorted(vae or "the model's own" for vae in vaes)
        problems.append(f"the caches were encoded with different VAEs ({', '.join(names)}): re-cache them with one")
    if len(text_lengths) > 1:
        problems.append(
            f"the caches were encoded with different --max_token_length ({', '.join(map(str, sorted(text_lengths)))}): "
            "re-cache them with one, as a batch may mix their items"
        )
    first = infos[cache_dirs[0]]
    return CacheCheck(taken, problems, cache_vae(first), first.text_max_length // TEXT_MAX_LENGTH)


def _model_problems(model: str, single_file_config: str) -> list[str]:
    """A model that cannot be found, named by its flag (checked before anything reads it)."""
    problems = [model_location_problem(model, "--pretrained_model_name_or_path")]
    if is_single_file(model):
        problems.append(model_location_problem(single_file_config, "--single_file_config"))
    return [problem for problem in problems if problem]


def _take_cache_settings(wanted: CacheRequirements, infos: dict[CacheLocation, CacheSettings]) -> tuple[dict[str, object], list[str]]:
    """What the requirements leave unset, from the caches: the model they were made from and their resolution
    range (over several caches: the smallest and the largest category; a batch never mixes bucket sizes, so
    caches of different ranges train together). A flag that is given must agree; returns the fields and the
    conflicts."""
    taken: dict[str, object] = {}
    problems = []
    ranges = {
        "min_resolution": min(infos.items(), key=lambda entry: entry[1].min_resolution),
        "max_resolution": max(infos.items(), key=lambda entry: entry[1].max_resolution),
    }
    for name, (cache_dir, info) in ranges.items():
        cached, given = getattr(info, name), getattr(wanted, name)
        if given is None:
            taken[name] = cached
        elif given != cached:
            problems.append(
                f"--{name} {given} does not match the caches: {cache_dir} was made with --{name} {cached}; drop the flag "
                f"(the trainer takes the range from the caches) or re-cache with --{name} {given}"
            )
    if wanted.pretrained_model_name_or_path is None:
        models = sorted({info.pretrained_model_name_or_path for info in infos.values()})
        if len(models) > 1:
            problems.append(f"the caches were made from models named {', '.join(models)}: name the one to train with --pretrained_model_name_or_path")
        elif problem := model_location_problem(models[0], "the caches' model (as their cache_info.json names it; pass --pretrained_model_name_or_path where it moved)"):
            problems.append(problem)
        else:
            taken["pretrained_model_name_or_path"] = models[0]
    return taken, problems


def write_empty_prompt(cache_dir: CacheLocation, prompt_embeds: torch.Tensor, pooled_prompt_embeds: torch.Tensor) -> None:
    """Written once: every worker computes the same tensors (same settings), so the first one keeps them."""
    store = open_store(cache_dir)
    store.remove_stale_staging(EMPTY_PROMPT_FILE)
    if store.exists(EMPTY_PROMPT_FILE):
        return
    staged = store.staging_path(EMPTY_PROMPT_FILE)
    try:
        save_file(
            {
                "prompt_embeds": prompt_embeds.to(STORAGE_DTYPE).contiguous(),
                "pooled_prompt_embeds": pooled_prompt_embeds.to(STORAGE_DTYPE).contiguous(),
            },
            staged,
        )
        make_shareable(staged)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    store.publish_once(staged, EMPTY_PROMPT_FILE)


def read_empty_prompt(cache_dir: CacheLocation) -> tuple[torch.Tensor, torch.Tensor]:
    store = open_store(cache_dir)
    try:
        tensors = load(store.read_bytes(EMPTY_PROMPT_FILE))
    except FileNotFoundError:
        raise CacheError(f"{store.location(EMPTY_PROMPT_FILE)} not found: the cache is incomplete; re-run sdxl_process_data_dir.py.") from None
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


class WorkerLock:
    """One process per worker name and cache: a second one started by mistake would redo all the work and race on
    the same files. In a folder, a ProcessLock (flock) on locks/<worker>.lock; in object storage, which has no
    locks, a lease object there (LEASE_S)."""

    def __init__(self, cache_dir: CacheLocation, worker_name: str):
        store = open_store(cache_dir)
        try:
            self._lock = ObjectLease(store, f"{LOCK_DIR}/{worker_name}.lock") if store.remote else ProcessLock(store.root / LOCK_DIR / f"{worker_name}.lock")
        except LockHeld as held:
            raise CacheError(
                f"{held} is already caching worker {worker_name} into {store}: wait for it to finish, or give this "
                "process another --shard_index / --num_shards"
            ) from None

    def release(self) -> None:
        self._lock.release()


class ShardWriter:
    """Writes one worker's shards and manifest parts. `worker_name` must be unique among writers."""

    def __init__(self, cache_dir: CacheLocation, worker_name: str):
        self.store = open_store(cache_dir)
        self.worker_name = worker_name
        self.store.make_folders(SHARD_DIR, MANIFEST_DIR)
        existing = [int(Path(name).stem.rsplit("-", 1)[1]) for name in self._mine(MANIFEST_DIR, ".parquet")]
        self.next_seq = max(existing, default=-1) + 1
        # The cache script writes both shared files before any shard, and they never change afterwards.
        self.shared_file_checksums = {key: self.store.sha256(name) for name, key in SHARED_FILE_CHECKSUM_KEYS.items() if self.store.exists(name)}
        self._remove_leftovers()

    def _mine(self, folder: str, suffix: str) -> list[str]:
        return [name for name in self.store.names(folder, suffix) if Path(name).name.startswith(f"{self.worker_name}-")]

    def _remove_leftovers(self) -> None:
        """Delete what a killed run of this same worker left unfinished: temporary files and shards without a
        manifest part. Only this worker writes files with its name, so nothing of another worker is touched."""
        committed = {Path(name).stem for name in self._mine(MANIFEST_DIR, ".parquet")}
        for folder in (SHARD_DIR, MANIFEST_DIR):
            self.store.remove_staging_of(folder, self.worker_name)
        for name in self._mine(SHARD_DIR, ".safetensors"):
            if Path(name).stem not in committed:
                self.store.remove(name)

    def write(self, items: list[CachedItem]) -> str:
        """Write `items` as one shard + manifest part; returns the manifest part's name (relative to the cache).

        On any error (a full disk above all) the staged file is removed and the error re-raised: what was
        committed before stays valid, and nothing half-written is left under a final name."""
        name = f"{self.worker_name}-{self.next_seq:06d}"
        shard_name = f"{SHARD_DIR}/{name}.safetensors"
        tensors = {}
        for index, item in enumerate(items):
            for key in TENSOR_KEYS:
                tensors[f"{index}/{key}"] = getattr(item, key).to(STORAGE_DTYPE).contiguous()
            if item.latents_flipped is not None:
                tensors[f"{index}/{FLIPPED_KEY}"] = item.latents_flipped.to(STORAGE_DTYPE).contiguous()
            if item.loss_mask is not None:
                tensors[f"{index}/{LOSS_MASK_KEY}"] = item.loss_mask.to(STORAGE_DTYPE).contiguous()
        staged = self.store.staging_path(shard_name)
        try:
            save_file(tensors, staged)
            make_shareable(staged)
            shard_sha256, shard_bytes = sha256_file(staged), staged.stat().st_size
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.store.publish(staged, shard_name)

        rows = [dict(item.row, shard=Path(shard_name).name, index_in_shard=index) for index, item in enumerate(items)]
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).replace_schema_metadata(
            {
                "shard": Path(shard_name).name,
                "shard_sha256": shard_sha256,
                "shard_bytes": str(shard_bytes),
                "written_at_ns": str(time.time_ns()),
                **self.shared_file_checksums,
            }
        )
        part_name = f"{MANIFEST_DIR}/{name}.parquet"
        staged = self.store.staging_path(part_name)
        try:
            pq.write_table(table, staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.store.publish(staged, part_name)
        self.next_seq += 1
        return part_name


@dataclass(frozen=True)
class ManifestPart:
    """One committed shard: its manifest part file and what the part records about the shard."""

    name: str  # the .parquet file, relative to the cache: manifest/<worker>-<seq>.parquet
    shard: str  # file name inside shards/
    shard_sha256: str
    shard_bytes: int
    written_at_ns: int
    num_rows: int
    shared_file_sha256: dict[str, str]  # file name -> SHA-256 (SHARED_FILE_CHECKSUM_KEYS); empty in older caches


def _read_part(store: Store, name: str) -> tuple[ManifestPart, pa.Table]:
    handle = pq.ParquetFile(pa.BufferReader(store.read_bytes(name)))
    metadata = handle.schema_arrow.metadata or {}
    table = handle.read(use_threads=False)  # parts are small: the parallelism is across parts
    if not table.schema.equals(MANIFEST_SCHEMA):
        for column in ("crop_left_flipped", "has_loss_mask", "mask_sha256"):  # a part from before flipped latents or masks
            if column not in table.column_names:
                table = table.append_column(column, pa.nulls(len(table), MANIFEST_SCHEMA.field(column).type))
        table = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    part = ManifestPart(
        name=name,
        shard=metadata[b"shard"].decode(),
        shard_sha256=metadata[b"shard_sha256"].decode(),
        shard_bytes=int(metadata[b"shard_bytes"]),
        written_at_ns=int(metadata[b"written_at_ns"]),
        num_rows=len(table),
        shared_file_sha256={file: metadata[key.encode()].decode() for file, key in SHARED_FILE_CHECKSUM_KEYS.items() if key.encode() in metadata},
    )
    return part, table


def read_manifest_parts(cache_dir: CacheLocation) -> tuple[list[tuple[ManifestPart, pa.Table]], dict[str, str]]:
    """Every manifest part in write order, and the unreadable ones (name relative to the cache -> reason).

    Parts are read in parallel threads (Parquet decoding releases the GIL, and object storage answers many
    requests at once): a million items in a few thousand parts load in seconds."""
    store = open_store(cache_dir)
    part_names = store.names(MANIFEST_DIR, ".parquet")
    parts, damaged = [], {}

    def read(name: str):
        try:
            return _read_part(store, name)
        except StorageError:
            raise  # the storage, not the part: no reason to call it damaged
        except (OSError, KeyError, ValueError, pa.ArrowException) as error:
            return f"unreadable manifest part ({type(error).__name__}: {error})"

    with ThreadPoolExecutor(REMOTE_READ_THREADS if store.remote else min(8, os.cpu_count() or 1)) as pool:
        for name, result in zip(part_names, pool.map(read, part_names)):
            if isinstance(result, str):
                damaged[name] = result
            else:
                parts.append(result)
    parts.sort(key=lambda item: (item[0].written_at_ns, item[0].name))
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


def intact_parts(cache_dir: CacheLocation) -> list[tuple[ManifestPart, pa.Table]]:
    """Every manifest part; a damaged one is a CacheError."""
    parts, damaged = read_manifest_parts(cache_dir)
    if damaged:
        name, reason = next(iter(damaged.items()))
        store = open_store(cache_dir)
        raise CacheError(f"{store.location(name)}: {reason}. {repair_advice(store)}")
    return parts


def load_manifest(cache_dir: CacheLocation) -> pa.Table:
    """All manifest parts merged into one table. When an image was cached more than once (edited and
    re-cached), the row from the most recently written part wins. A damaged part is a CacheError."""
    return merge_parts(intact_parts(cache_dir))


def repair_advice(cache_dir: CacheLocation) -> str:
    return (
        f"Run `{VERIFY_COMMAND.format(cache_dir=cache_dir)}` to list the damage, then re-run the cache command "
        "(sdxl_process_data_dir.sh with the same flags) to re-encode the affected items."
    )


def shard_problem(cache_dir: CacheLocation, part: ManifestPart, full_checksum: bool = True) -> str | None:
    """Why `part`'s shard cannot be trusted (missing, wrong size, checksum mismatch), or None if it is intact.

    Without full_checksum only the size is compared: cheap enough for every file open of the trainer."""
    store = open_store(cache_dir)
    name = f"{SHARD_DIR}/{part.shard}"
    problem = size_problem(store.size(name), part.shard_bytes)
    if problem is None and full_checksum and store.sha256(name) != part.shard_sha256:
        return "checksum mismatch (contents changed since it was written)"
    return problem


def size_problem(size: int | None, recorded: int) -> str | None:
    """A shard's size (None: missing) against the one its manifest part records."""
    if size is None:
        return "missing"
    return f"size {size} bytes, manifest says {recorded}" if size != recorded else None


def expected_shapes(row: dict, text_max_length: int) -> dict[str, tuple[int, ...]]:
    """Shapes (without the channel / width dimension) an item's tensors must have, from its manifest row."""
    return {
        "latents": (row["bucket_height"] // LATENT_DOWNSCALE, row["bucket_width"] // LATENT_DOWNSCALE),
        "prompt_embeds": (text_max_length,),
    }


def row_problems(shapes: dict[str, tuple[int, ...]], rows: list[dict], text_max_length: int, flip_aug: bool = False) -> list[str]:
    """Manifest rows checked against their shard's tensor shapes (name -> shape): every tensor present (the
    flipped latents too in a --flip_aug cache, the loss mask of a row with has_loss_mask), latents and mask
    matching the bucket."""
    problems = []
    for row in rows:
        label = f"item {row['index_in_shard']} ({row['image_path']})"
        latent_keys = ("latents", FLIPPED_KEY) if flip_aug else ("latents",)
        spatial_keys = (*latent_keys, LOSS_MASK_KEY) if row.get("has_loss_mask") else latent_keys
        missing = [key for key in dict.fromkeys((*TENSOR_KEYS, *spatial_keys)) if f"{row['index_in_shard']}/{key}" not in shapes]
        if missing:
            problems.append(f"{label}: tensors {missing} missing")
            continue
        wanted = expected_shapes(row, text_max_length)
        for key in spatial_keys:
            latents = shapes[f"{row['index_in_shard']}/{key}"]
            if latents[1:] != wanted["latents"]:
                problems.append(f"{label}: {key} {latents} do not match bucket {row['bucket_width']}x{row['bucket_height']}")
        embeds = shapes[f"{row['index_in_shard']}/prompt_embeds"]
        if embeds[:1] != wanted["prompt_embeds"]:
            problems.append(f"{label}: prompt_embeds {embeds} are not {text_max_length} tokens long")
    return problems


def empty_prompt_problem(store: Store, text_max_length: int) -> str | None:
    """What is wrong with the empty caption's embeddings as far as they can be checked without a checksum:
    unreadable, other tensors, or another caption length than the cache's."""
    try:
        tensors = load(store.read_bytes(EMPTY_PROMPT_FILE))
    except StorageError:
        raise
    except Exception as error:  # safetensors raises its own error types for bad headers
        return f"unreadable ({error})"
    if set(tensors) != {"prompt_embeds", "pooled_prompt_embeds"}:
        return f"holds the tensors {sorted(tensors)}, not prompt_embeds and pooled_prompt_embeds"
    length = tensors["prompt_embeds"].shape[0]
    if length != text_max_length:
        return f"prompt_embeds are {length} tokens long, but {CACHE_INFO_FILE} says {text_max_length}"
    return None


def shared_file_checks(store: Store, parts: list[tuple[ManifestPart, pa.Table]], text_max_length: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """cache_info.json and empty_prompt.safetensors against the SHA-256 the manifest parts recorded.

    Returns (problems, notes) by file name. Where no part recorded a checksum (a cache written before they
    were kept, or one without items) a note says so and only what reads can be checked: cache_info.json
    parses (read_cache_info) and the empty prompt holds its two tensors at the cache's caption length."""
    problems: dict[str, list[str]] = {}
    notes: dict[str, str] = {}
    for name in SHARED_FILE_CHECKSUM_KEYS:
        if not store.exists(name):
            problems[name] = ["missing"]
            continue
        recorded = [(part, part.shared_file_sha256[name]) for part, _ in parts if name in part.shared_file_sha256]
        if recorded:
            actual = store.sha256(name)
            differing = [part for part, digest in recorded if digest != actual]
            if differing:
                problems[name] = [
                    f"checksum mismatch (contents changed since {differing[0].name} recorded it): delete it and re-run "
                    "the cache command with the same flags, which writes it again"
                ]
            continue
        notes[name] = (
            "no checksum recorded (no manifest part records one: the cache was written before they were kept, or holds no items), "
            "so only checked that it reads"
        )
        problem = empty_prompt_problem(store, text_max_length) if name == EMPTY_PROMPT_FILE else None
        if problem:
            problems[name] = [problem]
    return problems, notes


def verify_cache(cache_dir: CacheLocation) -> tuple[int, dict[str, list[str]], dict[str, str]]:
    """Check every shard against its checksum, every manifest row against its shard, and cache_info.json and
    empty_prompt.safetensors against theirs (shared_file_checks).

    Returns (items checked, problems by file name relative to cache_dir, notes by file name: what could not be
    checked). Reads every shard once."""
    store = open_store(cache_dir)
    settings = read_cache_info(store)
    parts, damaged_parts = read_manifest_parts(store)
    problems: dict[str, list[str]] = {name: [reason] for name, reason in damaged_parts.items()}
    shared_problems, notes = shared_file_checks(store, parts, settings.text_max_length)
    problems.update(shared_problems)
    if not store.is_folder(MANIFEST_DIR):
        problems[MANIFEST_DIR] = ["missing: the cache lists no items at all"]
    # A shard no manifest part lists: its part was lost (its items silently gone from the cache) or its write
    # was cut short. (Run --verify while no cache worker is writing: a shard is listed a moment after it is written.)
    listed = {f"{SHARD_DIR}/{part.shard}" for part, _ in parts}
    for name in store.names(SHARD_DIR, ".safetensors"):
        if name not in listed:
            problems[name] = ["no manifest part lists it: its items are missing from the cache"]
    checked = 0
    for part, table in parts:
        name = f"{SHARD_DIR}/{part.shard}"
        problem = shard_problem(store, part)
        if problem:
            problems[name] = [f"{problem} (listed in {part.name})"]
            continue
        try:
            found = row_problems(store.open_tensors(name).shapes(), table.to_pylist(), settings.text_max_length, settings.flip_aug)
        except StorageError:
            raise
        except Exception as error:  # safetensors raises its own error types for bad headers
            found = [f"unreadable ({error})"]
        if found:
            problems[name] = found
        checked += part.num_rows
    return checked, problems, notes


def quarantine(cache_dir: CacheLocation, *names: str) -> None:
    """Move damaged files (a shard and its manifest part, or an unreadable part; names relative to the cache) into
    damaged/, so their rows no longer count and their items get re-encoded. Another worker may have moved them
    already: fine."""
    store = open_store(cache_dir)
    for name in names:
        store.move(name, f"{DAMAGED_DIR}/{Path(name).name}")


def part_files(part: ManifestPart) -> tuple[str, str]:
    """The manifest part and the shard it commits, relative to the cache."""
    return part.name, f"{SHARD_DIR}/{part.shard}"


class CacheReader:
    """Reads items' tensors from shards, keeping a few shards open (a folder's memory-mapped by safetensors, an
    object's header in memory).

    A shard whose size differs from the one its manifest part records (truncated, replaced, missing) is
    refused with a CacheError naming the file; run --verify for the full checksum check. `shard_bytes`
    (shard file name -> size, from the manifest) saves reading the manifest again; without it, it is read
    on first use."""

    def __init__(self, cache_dir: CacheLocation, max_open_shards: int = 16, shard_bytes: dict[str, int] | None = None):
        self.store = open_store(cache_dir)
        self.max_open_shards = max_open_shards
        self._open_shards: OrderedDict[str, LocalTensors | RemoteTensors] = OrderedDict()
        self._shard_bytes = shard_bytes

    def _recorded_bytes(self, shard_name: str) -> int | None:
        if self._shard_bytes is None:  # read lazily: each DataLoader worker process reads its own copy
            self._shard_bytes = {part.shard: part.shard_bytes for part, _ in read_manifest_parts(self.store)[0]}
        return self._shard_bytes.get(shard_name)

    def _shard(self, shard_name: str) -> LocalTensors | RemoteTensors:
        handle = self._open_shards.get(shard_name)
        if handle is None:
            name = f"{SHARD_DIR}/{shard_name}"
            recorded = self._recorded_bytes(shard_name)
            problem = None
            if recorded is None:
                problem = "not listed in any manifest part"
            elif not self.store.remote:  # an object's size is checked against its header below, saving a request
                problem = size_problem(self.store.size(name), recorded)
            if problem is None:
                try:
                    handle = self.store.open_tensors(name)
                except FileNotFoundError:
                    problem = "missing"
                except StorageError:
                    raise
                except Exception as error:  # safetensors raises its own error types for bad headers
                    problem = f"unreadable ({error})"
            if problem is None and self.store.remote and handle.total_bytes != recorded:
                problem = f"size {handle.total_bytes} bytes by its header, manifest says {recorded}"
            if problem is not None:
                raise CacheError(f"cache shard {self.store.location(name)} is damaged: {problem}. {repair_advice(self.store)}")
            self._open_shards[shard_name] = handle
            if len(self._open_shards) > self.max_open_shards:
                self._open_shards.popitem(last=False)
        else:
            self._open_shards.move_to_end(shard_name)
        return handle

    def read(self, shard_name: str, index_in_shard: int, keys: tuple[str, ...] = TENSOR_KEYS) -> dict[str, torch.Tensor]:
        return self.read_many([(shard_name, index_in_shard, keys)])[0]

    def read_many(self, requests: list[tuple[str, int, tuple[str, ...]]]) -> list[dict[str, torch.Tensor]]:
        """Several items' tensors ((shard name, index in shard, keys) each): from object storage, concurrently."""
        opened = []
        for shard_name, index, keys in requests:
            shard = self._shard(shard_name)
            names = [f"{index}/{key}" for key in keys]
            missing = [key for key, name in zip(keys, names) if not shard.has(name)]
            if missing:
                self._unreadable(shard_name, index, f"tensors {missing} missing")
            opened.append((shard, names))
        try:
            found = self.store.read_items(opened)
        except StorageError:
            raise
        except Exception as error:  # safetensors raises its own error types
            shard_name, index, _ = requests[0]
            self._unreadable(shard_name, index if len(requests) == 1 else f"{index} (or another of {len(requests)} read together)", error, error)
        return [{name.split("/", 1)[1]: tensor for name, tensor in tensors.items()} for tensors in found]

    def _unreadable(self, shard_name: str, index: int | str, reason: object, cause: BaseException | None = None):
        raise CacheError(
            f"item {index} of cache shard {self.store.location(f'{SHARD_DIR}/{shard_name}')} is unreadable ({reason}). {repair_advice(self.store)}"
        ) from cause
