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
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import torch

from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.local_store import LocalStore
from sdxl_trainer.cache.s3_store import RemoteStore
from sdxl_trainer.cache.stores import open_store

Store = LocalStore | RemoteStore


CacheLocation = str | Path | Store  # a folder, or an s3:// URL (stores.py)


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


LOCK_NAME = re.compile(r"^w\d{4,}of\d{4,}\.lock$")  # locks/<worker>.lock
STAGING_NAME = re.compile(r"^\..+\.tmp$")  # a local file being written (local_store.staging_path)


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


def foreign_contents_problem(cache_dir: CacheLocation) -> str | None:
    """Why the caching script must not write into cache_dir (None: it may): it holds something but no
    cache_info.json, which a cache's first worker writes before anything else but its lock, so it is a model folder
    or the user's own files (whose manifest/*.parquet a re-run would move to damaged/ as unreadable parts). A folder
    holding only workers' locks and staging files is a first run stopped before cache_info.json: a cache."""
    store = open_store(cache_dir)
    if store.exists(CACHE_INFO_FILE):
        return None
    entries = [name for name in store.entries("") if not STAGING_NAME.match(name)]
    foreign = [name for name in entries if name != LOCK_DIR or not store.is_folder(LOCK_DIR)]
    if LOCK_DIR in entries and store.is_folder(LOCK_DIR):
        foreign += [f"{LOCK_DIR}/{name}" for name in store.entries(LOCK_DIR) if not LOCK_NAME.match(name)]
    if not foreign:
        return None
    listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (
        f"--cache_dir {cache_dir} is not empty but holds no {CACHE_INFO_FILE}, so it is no cache (it holds {listed}): give a new or "
        "empty folder, or an existing cache"
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


def cache_vae(info: CacheSettings) -> str | None:
    """The VAE a cache was encoded with, where it is not its model's own (--vae_name_or_path at caching)."""
    return None if info.vae_name_or_path == info.pretrained_model_name_or_path else info.vae_name_or_path


@dataclass
class CachedItem:
    """Tensors of one item as the cache writer receives them (any float dtype; stored as fp16)."""

    latents: torch.Tensor  # (4, H/8, W/8), already multiplied by the VAE scaling factor
    prompt_embeds: torch.Tensor  # (77, 2048): penultimate hidden states of both text encoders
    pooled_prompt_embeds: torch.Tensor  # (1280,): pooled output of text encoder 2
    row: dict  # manifest fields except shard and index_in_shard
    latents_flipped: torch.Tensor | None = None  # the mirrored crop's latents, with --flip_aug
    loss_mask: torch.Tensor | None = None  # (1, h, w) in [0, 1] at latent size, for an item with a mask


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


def part_files(part: ManifestPart) -> tuple[str, str]:
    """The manifest part and the shard it commits, relative to the cache."""
    return part.name, f"{SHARD_DIR}/{part.shard}"


def repair_advice(cache_dir: CacheLocation) -> str:
    return (
        f"Run `{VERIFY_COMMAND.format(cache_dir=cache_dir)}` to list the damage, then re-run the cache command "
        "(sdxl_process_data_dir.sh with the same flags) to re-encode the affected items."
    )
