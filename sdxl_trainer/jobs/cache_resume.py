"""What a re-run of the caching script keeps: this worker's items in intact shards; damaged shards and manifest
parts are set aside so their items are encoded again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc

from sdxl_trainer.cache.format import SHARD_DIR, part_files
from sdxl_trainer.cache.reader import merge_parts, read_manifest_parts
from sdxl_trainer.cache.stores import open_store
from sdxl_trainer.cache.verify import shard_problem
from sdxl_trainer.cache.writer import quarantine


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
