"""Reading a cache from S3-compatible object storage vs from a local folder: items/s through the trainer's own
data path (CachedDataset + a DataLoader over random batches), side by side in one run.

The cache is synthetic but SDXL-sized: per item 1024x1024 latents (4x128x128), 77x2048 prompt embeddings and
pooled embeddings in fp16 (about 450 KB), --items_per_shard items per shard, written once to a folder and
once to a bucket of moto's S3 server on localhost (tests/support/s3_server.py). moto is a Python server whose ranged
GET costs grow with the object's size (it reads the object to slice it), so the bucket's figures are its
pace, not S3's or MinIO's: the last line, the same byte ranges fetched by s3fs alone in the same batches,
is that ceiling, and the data path's figure is to be read against it. The folder is read warm (page cache).

Run: python benchmarks/bench_object_storage.py [--items 512] [--items_per_shard 128] [--batch 8] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# The trainer's package and benchmarks.lib; tests/support/ for the tests' S3 server.
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests" / "support")]

from s3_server import make_bucket, s3_server  # noqa: E402

from benchmarks.lib.synthetic_cache import write_cache_for_unet  # noqa: E402
from sdxl_trainer.cache.format import SHARD_DIR, TENSOR_KEYS  # noqa: E402
from sdxl_trainer.cache.s3_store import RemoteTensors  # noqa: E402
from sdxl_trainer.cache.stores import open_store  # noqa: E402
from sdxl_trainer.training.dataset import CachedDataset, collate  # noqa: E402


def read_rate(location: str | Path, batch: int, workers: int) -> dict:
    """Items/s over one pass in a random order, with the trainer's batch-at-once reads (CachedDataset.__getitems__)."""
    started = time.perf_counter()
    dataset = CachedDataset([location])
    order = np.random.default_rng(0).permutation(len(dataset)).tolist()
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[order[i : i + batch] for i in range(0, len(order), batch)],
                                         num_workers=workers, collate_fn=collate)
    first_batch_s = None
    items = 0
    for loaded in loader:
        items += len(loaded["latents"])
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - started
    elapsed = time.perf_counter() - started
    return {"items_per_s": round(items / elapsed, 1), "MB_per_s": round(items * 450e3 / elapsed / 1e6, 1), "first_batch_s": round(first_batch_s, 2)}


def raw_rate(url: str, batch: int) -> dict:
    """The server's own pace: the same items' byte ranges in the same order and batches, fetched by s3fs alone
    (cat_ranges; no decoding, no DataLoader): what no reader of this server can beat."""
    dataset = CachedDataset([url])
    store = open_store(url)
    headers = {shard: RemoteTensors(store, f"{SHARD_DIR}/{shard}") for shard in set(dataset.shard)}
    order = np.random.default_rng(0).permutation(len(dataset)).tolist()
    started = time.perf_counter()
    for first in range(0, len(order), batch):
        chosen = order[first : first + batch]
        spans = [headers[dataset.shard[i]].span([f"{dataset.index_in_shard[i]}/{key}" for key in TENSOR_KEYS]) for i in chosen]
        store.fs.cat_ranges([store._key(f"{SHARD_DIR}/{dataset.shard[i]}") for i in chosen], [a for a, _ in spans], [b for _, b in spans])
    elapsed = time.perf_counter() - started
    return {"items_per_s": round(len(order) / elapsed, 1), "MB_per_s": round(len(order) * 450e3 / elapsed / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--items_per_shard", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder, s3_server():
        make_bucket("bench")
        for location in (Path(folder) / "cache", "s3://bench/cache"):  # SDXL-sized items: the full-size UNet's shapes at 1024 px
            write_cache_for_unet(location, "sdxl", 1024, args.items, args.items_per_shard)
        read_rate(Path(folder) / "cache", args.batch, 0)  # warm the page cache
        for name, location in (("folder", Path(folder) / "cache"), ("s3 (moto on localhost)", "s3://bench/cache")):
            for workers in sorted({0, args.workers}):
                results[f"{name}, {workers} workers"] = read_rate(location, args.batch, workers)
                print(f"{name:24s} workers {workers}: {results[f'{name}, {workers} workers']}", flush=True)
        results["s3 (moto on localhost), s3fs ranged reads alone"] = raw_rate("s3://bench/cache", args.batch)
        print(f"s3fs ranged reads alone:           {results['s3 (moto on localhost), s3fs ranged reads alone']}", flush=True)
    print(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
