"""Host cost of the data path at dataset sizes no test reaches: the real EpochPlanner and DataStream over a
synthetic bucket assignment (no images, no model, no cache).

For each size (items) it runs, each in a fresh process so the peak resident memory is that case's alone:
  start   planner + stream built for the whole run and the first update read, as the trainer does it at
          start (its bucket checks included; not the synthetic assignment, which stands in for reading the
          manifests); peak resident memory of that process (one rank's);
  updates host time per update of the stream (plan bookkeeping, data position, DataLoader over a dataset
          that returns only the sample index) over the first updates of the run, and over updates read
          after a resume in the middle of epoch 0 (where a position that grows with the epoch costs most).
One process stands for rank 0 of --world_size ranks; every rank plans the same epochs, so this is each
rank's cost.

Run: python benchmarks/bench_data_path.py [--items 1000000 10000000] [--epochs 10] [--updates 300]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from sdxl_trainer.training.epochs import EpochPlanner, bucket_counts, small_buckets
from sdxl_trainer.training.stream import (
    DataPosition,  # noqa: E402
    DataStream,  # noqa: E402
)

NUM_BUCKETS = 40
SEED = 1234


class SampleIndices(torch.utils.data.Dataset):
    """Only the sample index: what the data path itself handles, without reading a cache."""

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        return {"sample_index": torch.tensor(sample, dtype=torch.int64)}


def synthetic_buckets(num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket sizes (N, 2), bucket ids (N,)): NUM_BUCKETS buckets, a few large and many small, as real
    aspect-ratio buckets are."""
    rng = np.random.default_rng(SEED)
    weights = 1.0 / np.arange(1, NUM_BUCKETS + 1)
    bucket = rng.choice(NUM_BUCKETS, size=num_items, p=weights / weights.sum())
    widths = 512 + 64 * bucket
    heights = 2048 - 64 * bucket
    sizes = np.stack([widths, heights], axis=1)
    return sizes, widths.astype(np.int64) * 100_000 + heights


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def stream_from(planner: EpochPlanner, position: DataPosition, args: argparse.Namespace) -> DataStream:
    return DataStream(SampleIndices(), planner, position, args.epochs, 0, args.train_batch_size, 0, torch.device("cpu"))


def per_update_ms(stream: DataStream, count: int) -> float:
    updates = iter(stream)
    next(updates)  # the first read starts the loader
    started = time.perf_counter()
    for _ in range(count):
        next(updates)
    return (time.perf_counter() - started) / count * 1000


def run_case(args: argparse.Namespace) -> dict[str, float]:
    baseline = rss_peak_mib()
    global_batch = args.train_batch_size * args.world_size
    sizes, ids = synthetic_buckets(args.case_items)  # what the trainer reads from the manifests: not timed
    started = time.perf_counter()
    trainable = np.arange(args.case_items)
    planner = EpochPlanner(ids, trainable, global_batch, args.gradient_accumulation_steps, SEED)
    bucket_counts(sizes, ids, planner.possible_samples())
    small_buckets(sizes, ids, planner.epoch_samples(0), global_batch)
    if args.case == "start":
        stream = stream_from(planner, DataPosition.epoch_start(0), args)
        next(iter(stream))
        return {"start_s": time.perf_counter() - started, "rss_peak_mib": rss_peak_mib(), "rss_before_mib": baseline}
    first = per_update_ms(stream_from(planner, DataPosition.epoch_start(0), args), args.updates)
    epoch0 = planner.plan(0, np.zeros(0, dtype=np.int64))
    half = epoch0.num_updates // 2
    consumed = epoch0.batches_through(half - 1).reshape(-1)
    resumed = DataPosition(0, half, np.zeros(0, dtype=np.int64), consumed)
    middle = per_update_ms(stream_from(planner, resumed, args), args.updates)
    return {"update_ms_epoch_start": first, "update_ms_mid_epoch": middle, "updates_per_epoch": epoch0.num_updates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, nargs="+", default=[1_000_000, 10_000_000], help="dataset sizes to measure")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the run the stream is built for")
    parser.add_argument("--updates", type=int, default=300, help="updates timed per measurement")
    parser.add_argument("--train_batch_size", type=int, default=4, help="per rank")
    parser.add_argument("--world_size", type=int, default=8, help="ranks the global batch is made for (one is run)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--case", choices=["start", "updates"], help=argparse.SUPPRESS)
    parser.add_argument("--case_items", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    print(
        f"global batch {args.train_batch_size} x {args.world_size} ranks, accumulation {args.gradient_accumulation_steps}, "
        f"{args.epochs} epochs, {NUM_BUCKETS} buckets; one process = one rank"
    )
    for items in args.items:
        results = {}
        for case in ("start", "updates"):
            command = [sys.executable, __file__, "--case", case, "--case_items", str(items), "--epochs", str(args.epochs),
                       "--updates", str(args.updates), "--train_batch_size", str(args.train_batch_size),
                       "--world_size", str(args.world_size), "--gradient_accumulation_steps", str(args.gradient_accumulation_steps)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.update(json.loads(output.strip().splitlines()[-1]))
        print(
            f"{items:>11,} items: start {results['start_s']:6.1f} s, peak RSS {results['rss_peak_mib'] / 1024:5.2f} GiB "
            f"({results['rss_before_mib'] / 1024:.2f} GiB after imports); per update {results['update_ms_epoch_start']:.3f} ms "
            f"at the epoch's start, {results['update_ms_mid_epoch']:.3f} ms after a resume at update "
            f"{results['updates_per_epoch'] // 2:,} of {results['updates_per_epoch']:,}",
            flush=True,
        )


if __name__ == "__main__":
    main()
