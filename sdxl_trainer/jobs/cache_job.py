"""The caching job of one worker: scan, dry run or verify, then read, prepare, encode and write its share.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import torch
from PIL import Image
from safetensors import SafetensorError
from tqdm import tqdm

from sdxl_trainer.cache.buckets import BUCKET_TABLE_VERSION
from sdxl_trainer.cache.format import (
    CACHE_INFO_FILE,
    EMPTY_PROMPT_FILE,
    LOG_DIR,
    SHARD_DIR,
    CachedItem,
    CacheSettings,
    captions_in,
    part_files,
    write_cache_info,
)
from sdxl_trainer.cache.reader import merge_parts, read_manifest_parts
from sdxl_trainer.cache.storage import CacheError, LeaseLost, StorageError, is_remote, open_store, sha256_file
from sdxl_trainer.cache.verify import shard_problem, verify_cache
from sdxl_trainer.cache.writer import ShardWriter, WorkerLock, quarantine, write_empty_prompt
from sdxl_trainer.jobs.cache_config import CacheConfig, resolve_device, resolve_dtype
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH, TOKENS_PER_CHUNK, Encoders, chunks_for, load_encoders, model_fingerprint
from sdxl_trainer.preparation.folders import scan_images
from sdxl_trainer.preparation.images import IMAGE_EXTENSIONS, UnreadableImage, upright_size
from sdxl_trainer.preparation.items import PreparedItem, SkippedItem, choose_bucket, prepare_item, read_caption, read_mask_file, read_source
from sdxl_trainer.preparation.scan import ScanProblem, SourcePair, worker_of
from sdxl_trainer.preparation.tables import (
    TableError,
    parse_column_names,
    scan_table,
)
from sdxl_trainer.preparation.tar_sources import scan_tar_shards
from sdxl_trainer.preparation.upscale import Upscaler, load_upscaler
from sdxl_trainer.runtime.files import write_error_reason
from sdxl_trainer.runtime.garbage_collection import exempt_live_objects_from_garbage_collection
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


def truncation_advice(max_token_length: int) -> str:
    longer = [length for length in (150, 225) if length > max_token_length]
    return f"raise --max_token_length ({' or '.join(map(str, longer))}) or shorten the caption" if longer else "shorten the caption"


def encode_chunk(
    encoders: Encoders, prepared: list[PreparedItem], batch_size: int, caption_chunks: int, settings: CacheSettings
) -> tuple[list[CachedItem], dict[str, int]]:
    """Encode images grouped by bucket (one VAE call needs one size), with --flip_aug their mirrors too, and each
    item's first caption (framed by the cache's caption prefix and suffix), in batches. Also returns the items
    whose caption was cut (relative path -> its token count)."""
    by_bucket: dict[tuple[int, int], list[PreparedItem]] = defaultdict(list)
    for item in prepared:
        by_bucket[(item.plan.bucket.width, item.plan.bucket.height)].append(item)
    cached = []
    truncated = {}
    for items in by_bucket.values():
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            pixels = torch.stack([item.pixels for item in batch])
            latents = encoders.encode_images(pixels)
            flipped = encoders.encode_images(torch.flip(pixels, dims=[-1])) if settings.flip_aug else None
            captions = encoders.encode_captions([settings.framed(captions_in(item.caption)[0]) for item in batch], caption_chunks)
            for index, item in enumerate(batch):
                cached.append(
                    CachedItem(
                        latents[index], captions.prompt_embeds[index], captions.pooled_prompt_embeds[index], item.manifest_row(),
                        None if flipped is None else flipped[index], item.loss_mask,
                    )
                )
                if captions.token_counts[index] > caption_chunks * TOKENS_PER_CHUNK:
                    truncated[item.source.relative_path] = captions.token_counts[index]
    return cached, truncated


def bounded_map(pool: ThreadPoolExecutor, function: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map in order, with at most `window` items in flight: decoded images wait in memory only
    as long as the encoders need, however many millions of items there are."""
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def dry_run(config: CacheConfig, sources: list[SourcePair], scan_problems: list[ScanProblem], worker_name: str) -> int:
    """Bucket histogram and counts from image headers and captions only (from a metadata table's width and
    height where it gives them, without opening the image)."""

    def plan(source: SourcePair):
        try:
            if source.table_size is not None:
                read_caption(source)
                width, height = source.table_size
            else:
                data, _, _ = read_source(source)
                try:
                    width, height = upright_size(data)
                except UnreadableImage as error:
                    raise SkippedItem(source, str(error), "unreadable image") from error
            crop, upscale_bucket = choose_bucket(source, width, height, config.min_resolution, config.max_resolution, config.upscale_to_resolution)
            return upscale_bucket or crop.bucket, upscale_bucket is not None
        except SkippedItem as skipped:
            return skipped

    histogram: Counter[str] = Counter()
    skipped: Counter[str] = Counter(problem.category for problem in scan_problems)
    print_scan_problems(scan_problems, worker_name)
    upscaled = 0
    with ThreadPoolExecutor(config.num_io_threads) as pool:
        for result in tqdm(bounded_map(pool, plan, sources, 4 * config.num_io_threads), total=len(sources), desc=f"scanning [{worker_name}]", unit="img"):
            if isinstance(result, SkippedItem):
                skipped[result.category] += 1
            else:
                histogram[str(result[0])] += 1
                upscaled += result[1]
    print(f"[{worker_name}] dry run over {len(sources)} images in {config.data_dir}: nothing was loaded or written.")
    print(f"{'bucket':>11}  items")
    for bucket, count in sorted(histogram.items(), key=lambda entry: tuple(int(side) for side in entry[0].split("x"))):
        print(f"{bucket:>11}  {count}")
    print(f"would cache {sum(histogram.values())} (upscaled: {upscaled}); would skip {sum(skipped.values())}"
          + (f" ({', '.join(f'{key}: {value}' for key, value in sorted(skipped.items()))})" if skipped else ""))
    return 0


def run_verify(cache_dir: str) -> int:
    try:
        checked, problems, notes = verify_cache(cache_dir)
    except CacheError as error:
        print(f"cannot verify: {error}")
        return 1
    for name, note in sorted(notes.items()):
        print(f"NOTE {name}: {note}")
    for name, found in sorted(problems.items()):
        for problem in found:
            print(f"DAMAGED {name}: {problem}")
    if problems:
        repair = (
            "Delete the damaged shards listed (a re-run checks a bucket's shards by size only), then re-run the cache command with the same "
            "flags: their items are re-encoded." if is_remote(cache_dir) else
            "Re-run the cache command with the same flags: damaged shards are moved to damaged/ and their items re-encoded."
        )
        print(f"{len(problems)} damaged or missing file(s) in {cache_dir}; {checked} items in intact shards. {repair}")
        return 1
    print(
        f"cache OK: {checked} items, every shard matches its checksum and every row its shard, and {CACHE_INFO_FILE} and "
        f"{EMPTY_PROMPT_FILE} {'read' if notes else 'match theirs'} ({cache_dir})"
    )
    return 0


def valid_cached_items(cache_dir: str, my_paths: set[str], num_threads: int, worker_name: str) -> dict[str, tuple[str, str, str | None]]:
    """image_path -> (image SHA-256, caption, mask file SHA-256) of this worker's items in intact shards.

    Shards holding any of this worker's items are checked against their checksums (each worker reads its
    own part of the cache once) in a folder, and against their sizes in object storage (an object is never
    half-written, and reading a bucket's share back would download it on every run; --verify reads it all);
    damaged ones and unreadable manifest parts are moved to damaged/, so their items are re-encoded below."""
    store = open_store(cache_dir)  # one connection pool for the checks below when the cache is in object storage
    checksums = not store.remote
    parts, damaged_parts = read_manifest_parts(store)
    for name, reason in damaged_parts.items():
        print(f"[{worker_name}] repair: {name} is {reason}; its items will be re-encoded")
        quarantine(store, name)
    wanted = pa.array(sorted(my_paths), pa.string())
    mine = [(part, table) for part, table in parts if pc.any(pc.is_in(table.column("image_path"), value_set=wanted)).as_py()]
    started = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        problems = list(pool.map(lambda entry: shard_problem(store, entry[0], full_checksum=checksums), mine))
    intact = []
    for (part, table), problem in zip(mine, problems):
        if problem is None:
            intact.append((part, table))
        else:
            print(f"[{worker_name}] repair: {SHARD_DIR}/{part.shard} is damaged ({problem}); its {part.num_rows} items will be re-encoded")
            quarantine(store, *part_files(part))
    if mine:
        print(f"[{worker_name}] checked {len(mine)} shards against their {'checksums' if checksums else 'sizes'} in {time.perf_counter() - started:.1f} s")
    manifest = merge_parts(intact)
    identity = zip(*(manifest.column(name).to_pylist() for name in ("image_sha256", "caption", "mask_sha256")))
    return dict(zip(manifest.column("image_path").to_pylist(), identity))


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


def print_scan_problems(scan_problems: list[ScanProblem], worker_name: str) -> None:
    for problem in scan_problems:
        print(f"[{worker_name}] skipping {problem.relative_path}: {problem.reason}")


def nothing_to_cache(config: CacheConfig, found: int, scan_problems: list[ScanProblem], worker_name: str) -> int:
    """No item falls to this worker: said before any model loads (seconds, not the minute loading takes), and
    nothing is written. `found`: the usable items the scan found (a folder's all, tars' and tables' this worker's).
    An empty share of a larger dataset is done (0); no usable item at all is refused (2)."""
    print_scan_problems(scan_problems, worker_name)
    listed = f" ({len(scan_problems)} skipped, listed above)" if scan_problems else ""
    if found:
        print(f"[{worker_name}] nothing to cache: none of the {found} images in {config.data_dir} falls to this worker (--num_shards {config.num_shards})")
        return 0
    if config.num_shards > 1 and (config.tar_shards or config.metadata_table):  # the scan saw this worker's share only
        print(f"[{worker_name}] nothing to cache: no usable item falls to this worker (--num_shards {config.num_shards}){listed}")
        return 0
    if config.tar_shards:
        source = f"the tars in --data_dir {config.data_dir} hold no usable samples (an image member with a .txt or .json caption member of its key)"
    elif config.metadata_table:
        source = f"--metadata_table {config.metadata_table} lists no usable images (after its filters)"
    else:
        source = f"--data_dir {config.data_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)}; searched recursively, hidden names skipped)"
    print(f"[{worker_name}] refused: {source}{listed}: nothing was loaded or written.")
    return 2


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
    # Only now the model libraries load (diffusers, transformers: 5-10 s), which a dry run or a refusal never waits for.
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
