"""A cache of any number of items that holds a manifest and nothing else (no images, no tensors): for the tests and
benchmarks of what grows with the number of items. The rows are made by Arrow's kernels (a million in about a
second; six through Python and numpy): item i is "folder<i % 997>/image_<i, 7 digits>.jpg", a 64-digit content
hash, the caption "caption <i>" (padded with " w" to caption_length characters, if longer), a bucket of
(512 + 64 * (i % 7)) x 1024, and row i % rows_per_part of shard "w0-<i // rows_per_part, 6 digits>.safetensors",
whose manifest part holds it. With shard_files = K, the parts name K shards in turn (part p: shard p % K), which
are written, with small tensors, so that the items can be read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from sdxl_trainer.cache.format import MANIFEST_DIR, MANIFEST_SCHEMA, SHARD_DIR, TENSOR_KEYS, CacheSettings, write_cache_info

SETTINGS = CacheSettings("model", "vae", "fingerprint", 512, 1024, 1, 0.13025, 77)
BLOCK_ROWS = 1 << 20  # rows made at a time


def shard_name(part: int) -> str:
    return f"w0-{part:06d}.safetensors"


def manifest_rows(first: int, count: int, rows_per_part: int, caption_length: int = 0, shard_files: int = 0) -> pa.Table:
    """Rows first .. first + count - 1 of the manifest."""
    index = np.arange(first, first + count)
    shard = index // rows_per_part % shard_files if shard_files else index // rows_per_part
    number = pa.array(index).cast(pa.string())

    def joined(*parts) -> pa.Array:
        return pc.binary_join_element_wise(*parts, "")

    caption = joined("caption ", number)
    if caption_length:
        caption = pc.utf8_rpad(caption, width=caption_length, padding=" ")
        caption = pc.replace_substring_regex(caption, pattern="  ", replacement=" w")  # words, not a run of spaces
    return pa.table(
        {
            "image_path": joined("folder", pa.array(index % 997).cast(pa.string()), "/image_", pc.utf8_lpad(number, width=7, padding="0"), ".jpg"),
            "image_sha256": pc.utf8_lpad(number, width=64, padding="0"),
            "caption": caption,
            "bucket_width": pa.array((index % 7 * 64 + 512).astype(np.int32)),
            "bucket_height": pa.array(np.full(count, 1024, np.int32)),
            "original_width": pa.array(np.full(count, 2000, np.int32)),
            "original_height": pa.array(np.full(count, 3000, np.int32)),
            "crop_top": pa.array(np.zeros(count, np.int32)),
            "crop_left": pa.array(np.zeros(count, np.int32)),
            "crop_left_flipped": pa.nulls(count, pa.int32()),
            "upscaled": pa.array(np.zeros(count, bool)),
            "has_loss_mask": pa.array(np.zeros(count, bool)),
            "mask_sha256": pa.nulls(count, pa.string()),
            "shard": joined("w0-", pc.utf8_lpad(pa.array(shard).cast(pa.string()), width=6, padding="0"), ".safetensors"),
            "index_in_shard": pa.array((index % rows_per_part).astype(np.int32)),
        },
        schema=MANIFEST_SCHEMA,
    )


def write_shard(path: Path, items: int) -> int:
    """A shard of `items` items with small tensors (latents 4 x 8 x 8); returns its size in bytes."""
    shapes = {"latents": (4, 8, 8), "prompt_embeds": (77, 16), "pooled_prompt_embeds": (8,)}
    save_file({f"{index}/{key}": torch.zeros(shapes[key], dtype=torch.float16) for index in range(items) for key in TENSOR_KEYS}, str(path))
    return path.stat().st_size


def write_manifest_cache(cache_dir: Path, num_items: int, rows_per_part: int = 256, caption_length: int = 0, shard_files: int = 0) -> Path:
    """`cache_dir` with cache_info.json and a manifest part per `rows_per_part` items, and the `shard_files`
    shards they name (0: none written). Returns cache_dir."""
    write_cache_info(cache_dir, SETTINGS)
    (cache_dir / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
    sizes = []
    if shard_files:
        (cache_dir / SHARD_DIR).mkdir(exist_ok=True)
        sizes = [write_shard(cache_dir / SHARD_DIR / shard_name(shard), rows_per_part) for shard in range(shard_files)]
    block = max(BLOCK_ROWS // rows_per_part, 1) * rows_per_part
    for start in range(0, num_items, block):
        rows = manifest_rows(start, min(block, num_items - start), rows_per_part, caption_length, shard_files)
        for offset in range(0, len(rows), rows_per_part):
            part = (start + offset) // rows_per_part
            shard = part % shard_files if shard_files else part
            metadata = {"shard": shard_name(shard), "shard_sha256": "0" * 64, "shard_bytes": str(sizes[shard] if sizes else 1), "written_at_ns": str(part)}
            pq.write_table(rows.slice(offset, rows_per_part).replace_schema_metadata(metadata), cache_dir / MANIFEST_DIR / f"w0-{part:06d}.parquet")
    return cache_dir
