"""Checking a cache without changing it: every shard against its checksum and size, every manifest row
against its shard, and the shared files against what each worker recorded.
"""

from __future__ import annotations

import pyarrow as pa

from sdxl_trainer.cache.buckets import LATENT_DOWNSCALE
from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.format import (
    EMPTY_PROMPT_FILE,
    FLIPPED_KEY,
    LOSS_MASK_KEY,
    MANIFEST_DIR,
    SHARD_DIR,
    SHARED_FILE_CHECKSUM_KEYS,
    TENSOR_KEYS,
    CacheLocation,
    ManifestPart,
    Store,
    read_cache_info,
)
from sdxl_trainer.cache.reader import empty_prompt_problem, read_manifest_parts, size_problem
from sdxl_trainer.cache.stores import open_store


def shard_problem(cache_dir: CacheLocation, part: ManifestPart, full_checksum: bool = True) -> str | None:
    """Why `part`'s shard cannot be trusted (missing, wrong size, checksum mismatch), or None if it is intact.

    Without full_checksum only the size is compared: cheap enough for every file open of the trainer."""
    store = open_store(cache_dir)
    name = f"{SHARD_DIR}/{part.shard}"
    problem = size_problem(store.size(name), part.shard_bytes)
    if problem is None and full_checksum and store.sha256(name) != part.shard_sha256:
        return "checksum mismatch (contents changed since it was written)"
    return problem


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
        problem = empty_prompt_problem(store.read_bytes(name), {}, text_max_length) if name == EMPTY_PROMPT_FILE else None
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
