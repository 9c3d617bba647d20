"""The caching job of one worker: scan, dry run or verify, then read, prepare, encode and write its share.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image
from safetensors import SafetensorError
from tqdm import tqdm

from sdxl_trainer.cache.buckets import BUCKET_TABLE_VERSION
from sdxl_trainer.cache.errors import CacheError, StorageError
from sdxl_trainer.cache.format import LOG_DIR, CacheSettings, captions_in, write_cache_info
from sdxl_trainer.cache.object_lease import LeaseLost
from sdxl_trainer.cache.stores import is_remote, open_store
from sdxl_trainer.cache.writer import ShardWriter, WorkerLock, write_empty_prompt
from sdxl_trainer.jobs.cache_config import CacheConfig, resolve_device, resolve_dtype
from sdxl_trainer.jobs.cache_encoding import encode_chunk, truncation_advice
from sdxl_trainer.jobs.cache_modes import dry_run, nothing_to_cache, run_verify
from sdxl_trainer.jobs.cache_resume import valid_cached_items
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH, chunks_for, load_encoders, model_fingerprint
from sdxl_trainer.preparation.folders import scan_images
from sdxl_trainer.preparation.items import PreparedItem, SkippedItem, prepare_item, read_mask_file, read_source
from sdxl_trainer.preparation.scan import ScanProblem, SourcePair, worker_of
from sdxl_trainer.preparation.tables import TableError, parse_column_names, scan_table
from sdxl_trainer.preparation.tar_sources import scan_tar_shards
from sdxl_trainer.preparation.upscale import Upscaler, load_upscaler
from sdxl_trainer.runtime.bounded_map import bounded_map
from sdxl_trainer.runtime.files import write_error_reason
from sdxl_trainer.runtime.garbage_collection import exempt_live_objects_from_garbage_collection
from sdxl_trainer.runtime.hashing import sha256_file
from sdxl_trainer.runtime.quiet_libraries import hide_library_progress_bars


class ErrorLog:
    """One line per skipped item (and per item cached with a note, such as a truncated caption), written as
    it happens so a crash keeps what was logged. For a cache in object storage (no appending there) the log is
    written to a local temporary file and uploaded into logs/ when the run ends."""

    def __init__(self, cache_dir: str | Path, worker_name: str):
        self.store = open_store(cache_dir)
        self.name = f"{LOG_DIR}/errors-{worker_name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        self.path = self.store.location(self.name)  # where the user finds it
        self._file = self.store.staging_path(self.name) if self.store.remote else self.store.root / self.name
        self._file.parent.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()
        self.notes: Counter[str] = Counter()
        self._handle = open(self._file, "a", encoding="utf-8")

    def skip(self, relative_path: str, reason: str, category: str) -> None:
        self.counts[category] += 1
        self._write(relative_path, reason)

    def note(self, relative_path: str, reason: str, category: str) -> None:
        """An item that was cached, with something the user should know."""
        self.notes[category] += 1
        self._write(relative_path, reason)

    def _write(self, relative_path: str, reason: str) -> None:
        try:
            self._handle.write(f"{relative_path}: {reason}\n")
            self._handle.flush()
        except OSError as error:
            raise WriteFailed(error) from error

    def close(self) -> None:
        self._handle.close()
        if not self.counts and not self.notes:
            self._file.unlink()
        elif self.store.remote:
            try:
                self.store.publish(self._file, self.name)
            except StorageError as error:
                self.path = f"{self._file} (not uploaded: {error})"


class UpscaleSamples:
    """Saves the first `limit` before/after pairs (0 = all) as PNGs named after the item's relative path."""

    def __init__(self, folder: Path, limit: int):
        self.folder = folder
        self.limit = limit
        self.saved = 0
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, source: SourcePair, before: Image.Image, after: Image.Image) -> None:
        with self._lock:
            if self.limit and self.saved >= self.limit:
                return
            self.saved += 1
        stem = Path(source.relative_path).with_suffix("").as_posix().replace("/", "__")
        try:
            before.save(self.folder / f"{stem}.before.png")
            after.save(self.folder / f"{stem}.after.png")
        except OSError as error:  # a full disk here must stop the run like any other write
            raise WriteFailed(error) from error


class WriteFailed(Exception):
    """Writing into the cache failed (full disk, permissions, ...); what was committed before stays valid."""


def run_caching(config: CacheConfig) -> int:
    """The job sdxl_process_data_dir.py runs: --verify, or this worker's scan, then a dry run or its caching.
    Returns the exit code: 0 done, 1 stopped (the cache written so far stays valid), 2 refused."""
    if config.verify:
        return run_verify(config.cache_dir)
    exempt_live_objects_from_garbage_collection()
    worker_name = f"w{config.shard_index:04d}of{config.num_shards:04d}"
    started = time.perf_counter()
    def mine(relative_path: str) -> bool:  # tar shards are split whole, by scan_tar_shards
        return config.tar_shards or worker_of(relative_path, config.num_shards) == config.shard_index

    if config.tar_shards:
        scan = scan_tar_shards(config.data_dir, config.num_shards, config.shard_index)
    elif config.metadata_table:
        try:
            scan = scan_table(config.metadata_table, Path(config.data_dir), config.table_filters(), mine, parse_column_names(config.table_columns or []))
        except TableError as error:
            print(f"[{worker_name}] refused: {error}")
            return 2
    else:
        scan = scan_images(Path(config.data_dir))
    sources = [pair for pair in scan.pairs if mine(pair.relative_path)]
    scan_problems = [problem for problem in scan.problems if mine(problem.relative_path)]
    if config.dry_run:
        return dry_run(config, sources, scan_problems, worker_name)
    if not sources:
        return nothing_to_cache(config, len(scan.pairs), scan_problems, worker_name)
    try:
        lock = WorkerLock(config.cache_dir, worker_name)
    except CacheError as error:
        print(f"[{worker_name}] refused: {error}")
        return 2
    except OSError as error:
        print(stopped_message(worker_name, config.cache_dir, error, 0))
        return 1
    try:
        return cache_images(config, sources, scan_problems, worker_name, started, lock)
    except WriteFailed as failure:
        print(stopped_message(worker_name, config.cache_dir, failure.__cause__, 0))
        return 1
    except StorageError as error:  # reading the cache's manifest before any write
        print(f"[{worker_name}] stopped: {error}")
        return 1
    finally:
        lock.release()


def stopped_message(worker_name: str, cache_dir: str, error: BaseException, committed: int) -> str:
    reason = write_error_reason(error, None if is_remote(cache_dir) else Path(cache_dir))
    return (
        f"\n[{worker_name}] stopped: cannot write into {cache_dir} ({reason}: {error}). The {committed} items "
        "committed in this run and everything cached before are kept; free space (or fix the folder) and re-run the same "
        "command to cache the rest."
    )


def cache_images(config: CacheConfig, sources: list[SourcePair], scan_problems: list[ScanProblem], worker_name: str, started: float, lock: WorkerLock) -> int:

    already_cached = valid_cached_items(config.cache_dir, {s.relative_path for s in sources}, config.num_io_threads, worker_name)
    print(f"[{worker_name}] {len(sources)} images to check in {config.data_dir}; {len(already_cached)} of them already in {config.cache_dir}")
    unused_masks = sum(source.mask_path is not None for source in sources) if not config.mask_files else 0
    if unused_masks:
        print(f"[{worker_name}] {unused_masks} images have a mask file (name.mask.png) that is not cached: pass --mask_files to train with them")

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.encode_dtype, device)
    vae_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.vae_dtype]
    # Only now the model libraries load (diffusers, transformers: seconds of CPU), which a dry run or a refusal never waits for.
    hide_library_progress_bars()
    encoders = load_encoders(config.pretrained_model_name_or_path, config.vae_name_or_path, device, dtype, config.single_file_config, vae_dtype)
    exempt_live_objects_from_garbage_collection()  # the model libraries' objects too, imported by now
    caption_chunks = chunks_for(config.max_token_length)
    settings = CacheSettings(
        pretrained_model_name_or_path=config.pretrained_model_name_or_path,
        vae_name_or_path=config.vae_name_or_path or config.pretrained_model_name_or_path,
        model_fingerprint=model_fingerprint(config.pretrained_model_name_or_path, config.vae_name_or_path, config.single_file_config),
        min_resolution=config.min_resolution,
        max_resolution=config.max_resolution,
        bucket_table_version=BUCKET_TABLE_VERSION,
        latent_scaling_factor=encoders.latent_scaling_factor,
        text_max_length=caption_chunks * TEXT_MAX_LENGTH,
        upscale_to_resolution=config.upscale_to_resolution or None,
        upscaler_sha256=sha256_file(config.upscaler_weights) if config.upscale_to_resolution else None,
        face_restorer_sha256=sha256_file(config.gfpgan_weights) if config.upscale_to_resolution and config.upscale_use_GFPGAN else None,
        caption_prefix=config.caption_prefix,
        caption_suffix=config.caption_suffix,
        flip_aug=config.flip_aug,
        mask_files=config.mask_files,
        alpha_mask=config.alpha_mask,
    )
    try:
        write_cache_info(config.cache_dir, settings)
        empty = encoders.encode_captions([""], caption_chunks)
        write_empty_prompt(config.cache_dir, empty.prompt_embeds[0], empty.pooled_prompt_embeds[0])
    except CacheError as error:
        print(f"[{worker_name}] refused: {error}")
        return 2
    except (OSError, SafetensorError) as error:
        raise WriteFailed(error) from error
    upscaler: Upscaler | None = None
    if config.upscale_to_resolution:
        upscaler = load_upscaler(
            config.upscaler_weights,
            config.gfpgan_weights if config.upscale_use_GFPGAN else None,
            config.facexlib_weights_dir,
            device,
            dtype,
            config.upscale_tile_size,
            config.upscale_tile_padding,
        )
    samples = UpscaleSamples(config.save_upscale_samples, config.max_upscale_samples) if config.save_upscale_samples else None

    try:
        writer = ShardWriter(config.cache_dir, worker_name)
        errors = ErrorLog(config.cache_dir, worker_name)
    except (OSError, StorageError) as error:
        raise WriteFailed(error) from error
    counts: Counter[str] = Counter()

    def load(source: SourcePair) -> PreparedItem | SkippedItem | None:
        """Runs in the I/O threads: returns a PreparedItem, None (already cached) or a SkippedItem."""
        try:
            data, image_sha256, caption = read_source(source)
            mask_file = read_mask_file(source) if config.mask_files else None
            if already_cached.get(source.relative_path) == (image_sha256, caption, mask_file[1] if mask_file else None):
                return None
            return prepare_item(
                source, data, image_sha256, caption, config.min_resolution, config.max_resolution, config.upscale_to_resolution, upscaler, samples,
                mask_file=mask_file, alpha_mask=config.alpha_mask,
            )
        except SkippedItem as skipped:
            return skipped

    def commit(items: list[PreparedItem]) -> None:
        encoded, truncated = encode_chunk(encoders, items, config.batch_size, caption_chunks, settings)
        try:
            lock.confirm()  # still this worker's (a lease in object storage is renewed now, or found taken over)
            writer.write(encoded)
            for item in items:
                if len(captions_in(item.caption)) > 1:
                    errors.note(
                        item.source.relative_path,
                        f"{len(captions_in(item.caption))} captions (one per line): the cached embeddings encode the first; "
                        "the trainer's --encode_captions_each_step chooses among all of them",
                        "several captions",
                    )
            for relative_path, token_count in truncated.items():
                errors.note(
                    relative_path,
                    f"caption of {token_count} tokens cut to its first {config.max_token_length}: {truncation_advice(config.max_token_length)}",
                    "caption truncated",
                )
        except (OSError, SafetensorError, StorageError) as error:  # safetensors reports a full disk as SafetensorError, not OSError
            raise WriteFailed(error) from error
        counts["cached"] += len(items)
        counts["upscaled"] += sum(item.upscaled for item in items)
        if config.mask_files or config.alpha_mask:
            counts["with a loss mask"] += sum(item.loss_mask is not None for item in items)

    progress = tqdm(
        total=len(sources), desc=f"caching [{worker_name}]", unit="img", position=int(os.environ.get("LOCAL_RANK", 0)), dynamic_ncols=True, mininterval=1.0
    )
    pending: list[PreparedItem] = []
    exit_code = 0
    try:
        for problem in scan_problems:
            errors.skip(problem.relative_path, problem.reason, problem.category)
        with ThreadPoolExecutor(config.num_io_threads) as pool:
            # Enough decoded items in flight to fill a shard while the encoders work on the previous one.
            for result in bounded_map(pool, load, sources, config.items_per_shard + 2 * config.num_io_threads):
                progress.update()
                if result is None:
                    counts["already cached"] += 1
                elif isinstance(result, SkippedItem):
                    errors.skip(result.source.relative_path, str(result), result.category)
                else:
                    pending.append(result)
                if len(pending) == config.items_per_shard:
                    commit(pending)
                    pending = []
            if pending:
                commit(pending)
    except WriteFailed as failure:
        print(stopped_message(worker_name, config.cache_dir, failure.__cause__, counts["cached"]))
        exit_code = 1
    except LeaseLost as lost:
        print(f"\n[{worker_name}] stopped: {lost}. The {counts['cached']} items committed before are kept.")
        exit_code = 1
    finally:
        progress.close()
        errors.close()

    elapsed = time.perf_counter() - started
    summary = ", ".join(f"{key}: {value}" for key, value in counts.items()) or "nothing to do"
    print(f"[{worker_name}] {'stopped' if exit_code else 'done'} after {elapsed:.1f} s ({counts['cached'] / elapsed:.2f} items/s). {summary}.")
    if errors.counts:
        skipped = ", ".join(f"{key}: {value}" for key, value in sorted(errors.counts.items()))
        print(f"[{worker_name}] skipped {sum(errors.counts.values())} ({skipped}); details in {errors.path}")
    if errors.notes["several captions"]:
        print(f"[{worker_name}] {errors.notes['several captions']} caption file(s) hold several captions (one per line); they are named in {errors.path}")
    if errors.notes["caption truncated"]:
        print(
            f"[{worker_name}] {errors.notes['caption truncated']} caption(s) longer than --max_token_length {config.max_token_length} "
            f"were cut; they are named in {errors.path}"
        )
    return exit_code
