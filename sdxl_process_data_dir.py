"""Cache a folder of image + caption pairs for SDXL training: VAE latents, both text embeddings, buckets.

For every image under --data_dir with a caption file of the same name (photo.jpg + photo.txt):
  1. read it upright (EXIF rotation), RGB, with transparency composited on white;
  2. skip it if it is smaller than the smallest bucket of --min_resolution (nothing is ever upscaled here);
  3. pick its aspect-ratio bucket (the largest resolution category up to --max_resolution that fits),
     resize it to cover the bucket and centre-crop; record SDXL's micro-conditioning (original size,
     crop top-left, target size);
  4. encode the crop with the VAE and the caption with both text encoders;
  5. write shards of tensors (safetensors) + manifest parts (Parquet) into --cache_dir (see cache.py).

Nothing is written into --data_dir. Re-running the same command skips items already cached with the same
image bytes and caption, and caches new or changed ones. Skipped items are listed, one line each with the
reason, in <cache_dir>/logs/. Several workers (one per GPU or machine) split the data with --num_shards
and --shard_index; see sdxl_process_data_dir.sh.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from sdxl_trainer.buckets import BUCKET_TABLE_VERSION, categories
from sdxl_trainer.cache import (
    CacheSettings,
    CachedItem,
    LOG_DIR,
    ShardWriter,
    load_manifest,
    write_cache_info,
    write_empty_prompt,
)
from sdxl_trainer.config import option, parse_config
from sdxl_trainer.encoding import Encoders, load_encoders, model_fingerprint
from sdxl_trainer.sources import PreparedItem, SkippedItem, prepare_item, read_source, scan_images, worker_of
from sdxl_trainer.tiny_model import TEXT_MAX_LENGTH


@dataclass
class CacheConfig:
    data_dir: Path = option(help="folder of images with captions in .txt files of the same name (searched recursively)")
    cache_dir: Path = option(help="folder to write the cache into; must not be inside --data_dir")
    pretrained_model_name_or_path: str = option(
        "stabilityai/stable-diffusion-xl-base-1.0", help="SDXL pipeline (hub id or local diffusers folder) whose text encoders and VAE encode the data"
    )
    vae_name_or_path: str | None = option(
        None, help="replacement VAE (hub id or folder), e.g. madebyollin/sdxl-vae-fp16-fix; None = the pipeline's own VAE"
    )
    min_resolution: int = option(512, help="smallest bucket category in px (multiple of 64, 256-2048); smaller images are skipped")
    max_resolution: int = option(1024, help="largest bucket category in px (multiple of 64, 256-2048); larger images are scaled down")
    batch_size: int = option(8, help="images per VAE / text-encoder call")
    items_per_shard: int = option(256, help="items per shard file; a shard is the unit that a killed run redoes")
    num_shards: int = option(1, help="number of workers splitting the dataset (all GPUs of all machines)")
    shard_index: int = option(0, help="which worker this is, 0 .. num_shards-1")
    device: str = option("auto", help="torch device for the encoders: auto = cuda:LOCAL_RANK if a GPU is present, else cpu")
    encode_dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", help="encoder precision: auto = bf16 on GPU, fp32 on CPU"
    )
    num_io_threads: int = option(4, help="threads that read, decode and crop images while the encoders run")

    def validate(self) -> list[str]:
        problems = []
        try:
            categories(self.min_resolution, self.max_resolution)
        except ValueError as error:
            problems.append(str(error))
        if not self.data_dir.is_dir():
            problems.append(f"--data_dir {self.data_dir} is not a folder")
        elif self.cache_dir.resolve().is_relative_to(self.data_dir.resolve()):
            problems.append(f"--cache_dir {self.cache_dir} is inside --data_dir: choose a folder outside the dataset")
        if not 0 <= self.shard_index < self.num_shards:
            problems.append(f"--shard_index {self.shard_index} must be in 0..{self.num_shards - 1} (--num_shards {self.num_shards})")
        for name in ("batch_size", "items_per_shard", "num_io_threads"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1")
        return problems


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class ErrorLog:
    """One line per skipped item, written as it happens so a crash keeps what was logged."""

    def __init__(self, cache_dir: Path, worker_name: str):
        self.path = cache_dir / LOG_DIR / f"errors-{worker_name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()
        self._handle = open(self.path, "a", encoding="utf-8")

    def skip(self, skipped: SkippedItem) -> None:
        self.counts[skipped.category] += 1
        self._handle.write(f"{skipped.source.relative_path}: {skipped}\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()
        if not self.counts:
            self.path.unlink()


def encode_chunk(encoders: Encoders, prepared: list[PreparedItem], batch_size: int) -> list[CachedItem]:
    """Encode images grouped by bucket (one VAE call needs one size) and captions in batches."""
    by_bucket: dict[tuple[int, int], list[PreparedItem]] = defaultdict(list)
    for item in prepared:
        by_bucket[(item.plan.bucket.width, item.plan.bucket.height)].append(item)
    cached = []
    for items in by_bucket.values():
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            latents = encoders.encode_images(torch.stack([item.pixels for item in batch]))
            prompt_embeds, pooled = encoders.encode_captions([item.caption for item in batch])
            for index, item in enumerate(batch):
                cached.append(CachedItem(latents[index], prompt_embeds[index], pooled[index], item.manifest_row()))
    return cached


def main(argv: list[str] | None = None) -> int:
    config = parse_config(CacheConfig, argv, description=__doc__)
    worker_name = f"w{config.shard_index:04d}of{config.num_shards:04d}"
    started = time.perf_counter()

    sources = [s for s in scan_images(config.data_dir) if worker_of(s.relative_path, config.num_shards) == config.shard_index]
    already_cached = {
        row["image_path"]: (row["image_sha256"], row["caption"])
        for row in load_manifest(config.cache_dir).select(["image_path", "image_sha256", "caption"]).to_pylist()
    }
    print(f"[{worker_name}] {len(sources)} images to check in {config.data_dir}; {len(already_cached)} items already in {config.cache_dir}")

    device = resolve_device(config.device)
    encoders = load_encoders(config.pretrained_model_name_or_path, config.vae_name_or_path, device, resolve_dtype(config.encode_dtype, device))
    settings = CacheSettings(
        pretrained_model_name_or_path=config.pretrained_model_name_or_path,
        vae_name_or_path=config.vae_name_or_path or config.pretrained_model_name_or_path,
        model_fingerprint=model_fingerprint(config.pretrained_model_name_or_path, config.vae_name_or_path),
        min_resolution=config.min_resolution,
        max_resolution=config.max_resolution,
        bucket_table_version=BUCKET_TABLE_VERSION,
        latent_scaling_factor=encoders.latent_scaling_factor,
        text_max_length=TEXT_MAX_LENGTH,
    )
    write_cache_info(config.cache_dir, settings)
    write_empty_prompt(config.cache_dir, *[tensor[0] for tensor in encoders.encode_captions([""])])

    writer = ShardWriter(config.cache_dir, worker_name)
    errors = ErrorLog(config.cache_dir, worker_name)
    counts: Counter[str] = Counter()

    def load(source):
        """Runs in the I/O threads: returns a PreparedItem, None (already cached) or a SkippedItem."""
        try:
            data, image_sha256, caption = read_source(source)
            if already_cached.get(source.relative_path) == (image_sha256, caption):
                return None
            return prepare_item(source, data, image_sha256, caption, config.min_resolution, config.max_resolution)
        except SkippedItem as skipped:
            return skipped

    progress = tqdm(total=len(sources), desc=f"caching [{worker_name}]", unit="img", dynamic_ncols=True)
    pending: list[PreparedItem] = []
    with ThreadPoolExecutor(config.num_io_threads) as pool:
        for result in pool.map(load, sources):
            progress.update()
            if result is None:
                counts["already cached"] += 1
            elif isinstance(result, SkippedItem):
                errors.skip(result)
            else:
                pending.append(result)
            if len(pending) == config.items_per_shard:
                writer.write(encode_chunk(encoders, pending, config.batch_size))
                counts["cached"] += len(pending)
                pending = []
        if pending:
            writer.write(encode_chunk(encoders, pending, config.batch_size))
            counts["cached"] += len(pending)
    progress.close()
    errors.close()

    summary = ", ".join(f"{key}: {value}" for key, value in counts.items()) or "nothing to do"
    skipped = ", ".join(f"{key}: {value}" for key, value in sorted(errors.counts.items()))
    print(f"[{worker_name}] done in {time.perf_counter() - started:.1f} s. {summary}.")
    if skipped:
        print(f"[{worker_name}] skipped {sum(errors.counts.values())} ({skipped}); details in {errors.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
