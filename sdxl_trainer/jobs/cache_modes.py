"""The caching script's runs that write no cache: --dry_run, --verify, and a worker with nothing to cache.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import CACHE_INFO_FILE, EMPTY_PROMPT_FILE
from sdxl_trainer.cache.stores import is_remote
from sdxl_trainer.cache.verify import verify_cache
from sdxl_trainer.jobs.cache_config import CacheConfig
from sdxl_trainer.preparation.images import IMAGE_EXTENSIONS, UnreadableImage, upright_size
from sdxl_trainer.preparation.items import SkippedItem, choose_bucket, read_caption, read_source
from sdxl_trainer.preparation.scan import ScanProblem, SourcePair
from sdxl_trainer.runtime.bounded_map import bounded_map


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
