"""Host cost of the data path at dataset sizes no test reaches.

Planner and stream (--items): the real EpochPlanner and DataStream over a synthetic bucket assignment (no
images, no model, no cache). For each size, each in a fresh process so the peak resident memory is that
case's alone:
  start   planner + stream built for the whole run and the first update read, as the trainer does it at
          start (its bucket checks included; not the synthetic assignment, which stands in for reading the
          manifests); peak resident memory of that process (one rank's);
  updates host time per update of the stream (plan bookkeeping, data position, DataLoader over a dataset
          that returns only the sample index) over the first updates of the run, and over updates read
          after a resume in the middle of epoch 0 (where a position that grows with the epoch costs most).
One process stands for rank 0 of --world_size ranks; every rank plans the same epochs, so this is each
rank's cost.

The whole data path (--manifest_items): a cache whose manifest has that many items (parts of 256 rows, as
--items_per_shard writes them; tests/support/synthetic_manifest.py, captions of --caption_length characters) pointing
at a few small shards, opened as the trainer opens it: its flags (parse_config), load_training_data (the real
CachedDataset, the validation split, the planner), the captions the sample prompts are drawn from, then
--read_updates updates read through the DataLoader with --workers worker processes. Reported from /proc for
the rank and each worker: resident memory (RSS, which counts pages shared between them in each), proportional
(PSS, shared pages split, so the processes' PSS add up to the memory they take together) and private; for the
rank also the peak (VmHWM) and the figures after its imports. The manifests are kept in --manifest_dir.

Run: python benchmarks/bench_data_path.py [--items 1000000 10000000] [--epochs 10] [--updates 300]
     python benchmarks/bench_data_path.py --items --manifest_items 10000000 --manifest_dir /tmp/manifests
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests" / "support")]  # tests/support/ for the synthetic manifest

from sdxl_trainer.training.epochs import EpochPlanner, bucket_counts, small_buckets
from sdxl_trainer.training.stream import DataPosition, DataStream

NUM_BUCKETS = 40
SEED = 1234
ROWS_PER_PART = 256  # --items_per_shard's default
SHARD_FILES = 4  # the shards every part names in turn
GIB = 1024**3


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


def process_memory(pid: int) -> dict[str, int]:
    """A process's memory in bytes from /proc: rss, peak_rss (VmHWM), pss (shared pages split among their
    processes) and private (pages no other process maps)."""
    def fields(path: str) -> dict[str, int]:
        values = {}
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                values[name] = int(value.split()[0]) * 1024
        return values

    status, rollup = fields(f"/proc/{pid}/status"), fields(f"/proc/{pid}/smaps_rollup")
    return {"rss": status["VmRSS"], "peak_rss": status["VmHWM"], "pss": rollup["Pss"], "private": rollup["Private_Clean"] + rollup["Private_Dirty"]}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def run_dataset_case(args: argparse.Namespace) -> dict:
    """The trainer's data path over the manifest at args.manifest: memory after the imports, after opening
    it, and after args.read_updates updates through the DataLoader's workers."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.evaluation.sample_prompts import choose_sample_prompts
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.training.training_data import load_training_data

    imports = process_memory(os.getpid())
    config = parse_config(TrainConfig, [
        "--cached_dataset_dirs", args.manifest, "--train_batch_size", str(args.train_batch_size), "--dataloader_num_workers", str(args.workers),
        "--gradient_accumulation_steps", str(args.gradient_accumulation_steps), "--num_train_epochs", str(args.epochs),
    ])
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        data = load_training_data(config.data_settings(), Path(run_dir), SEED, args.world_size, is_main=True)
        dataset = data.dataset
        # What the evaluator draws the sample prompts from (before this benchmark existed: a list of every caption).
        captions = dataset.captions() if hasattr(dataset, "captions") else [dataset.caption(item) for item in range(len(dataset))]
        choose_sample_prompts([], captions, 8, SEED)
        del captions
        load_s = time.perf_counter() - started
        loaded = process_memory(os.getpid())
        updates = iter(data.stream(DataPosition.epoch_start(0), 0, 0, torch.device("cpu")))
        for _ in range(args.read_updates):
            next(updates)
        rank = process_memory(os.getpid())
        workers = [process_memory(pid) for pid in children_of(os.getpid())]
    return {"items": len(dataset), "load_s": load_s, "imports": imports, "loaded": loaded, "rank": rank, "workers": workers}


def manifest_for(items: int, args: argparse.Namespace) -> Path:
    """A cache of `items` items in args.manifest_dir, made once (a second run reuses it)."""
    folder = Path(args.manifest_dir) / f"{items}_items_{args.caption_length}_char_captions"
    done = folder / "made"
    if not done.exists():
        from synthetic_manifest import write_manifest_cache

        started = time.perf_counter()
        write_manifest_cache(folder, items, ROWS_PER_PART, args.caption_length, SHARD_FILES)
        done.touch()
        print(f"made a manifest of {items:,} items in {-(-items // ROWS_PER_PART):,} parts in {time.perf_counter() - started:.0f} s: {folder}", flush=True)
    return folder


def report_dataset(result: dict, args: argparse.Namespace) -> None:
    def gib(value: int) -> str:
        return f"{value / GIB:.2f}"

    rank, workers, imports = result["rank"], result["workers"], result["imports"]
    together_rss = rank["rss"] + sum(worker["rss"] for worker in workers)
    together_pss = rank["pss"] + sum(worker["pss"] for worker in workers)
    print(
        f"{result['items']:>11,} items, captions of {args.caption_length} characters: opened in {result['load_s']:.0f} s, "
        f"{args.read_updates} updates read by {len(workers)} workers\n"
        f"    rank: after its imports RSS {gib(imports['rss'])} GiB, PSS {gib(imports['pss'])}; opened RSS {gib(result['loaded']['rss'])}; "
        f"after the updates RSS {gib(rank['rss'])}, PSS {gib(rank['pss'])}, private {gib(rank['private'])}; peak RSS {gib(rank['peak_rss'])}\n"
        f"    workers: RSS {' + '.join(gib(worker['rss']) for worker in workers)} GiB, PSS {' + '.join(gib(worker['pss']) for worker in workers)}, "
        f"private {' + '.join(gib(worker['private']) for worker in workers)}\n"
        f"    rank + workers: RSS {gib(together_rss)} GiB (shared pages counted in each), PSS {gib(together_pss)} GiB; "
        f"the data path (PSS over the rank's after its imports): {gib(together_pss - imports['pss'])} GiB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, nargs="*", default=[1_000_000, 10_000_000], help="dataset sizes to measure the planner and stream at")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the run the stream is built for")
    parser.add_argument("--updates", type=int, default=300, help="updates timed per measurement")
    parser.add_argument("--train_batch_size", type=int, default=4, help="per rank")
    parser.add_argument("--world_size", type=int, default=8, help="ranks the global batch is made for (one is run)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--manifest_items", type=int, nargs="*", default=[], help="manifest sizes to measure the whole data path at")
    parser.add_argument("--manifest_dir", default=str(Path(tempfile.gettempdir()) / "bench_data_path_manifests"), help="where the manifests are made and kept")
    parser.add_argument("--caption_length", type=int, default=200, help="characters per caption in the manifests")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (--dataloader_num_workers)")
    parser.add_argument("--read_updates", type=int, default=200, help="updates read through the workers before measuring")
    parser.add_argument("--case", choices=["start", "updates", "dataset"], help=argparse.SUPPRESS)
    parser.add_argument("--case_items", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--manifest", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case == "dataset":
        print(json.dumps(run_dataset_case(args)))
        return
    if args.case:
        print(json.dumps(run_case(args)))
        return
    shared = ["--epochs", str(args.epochs), "--train_batch_size", str(args.train_batch_size), "--world_size", str(args.world_size),
              "--gradient_accumulation_steps", str(args.gradient_accumulation_steps)]
    print(
        f"global batch {args.train_batch_size} x {args.world_size} ranks, accumulation {args.gradient_accumulation_steps}, "
        f"{args.epochs} epochs, {NUM_BUCKETS} buckets; one process = one rank"
    )
    for items in args.items:
        results = {}
        for case in ("start", "updates"):
            command = [sys.executable, __file__, "--case", case, "--case_items", str(items), "--updates", str(args.updates), *shared]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.update(json.loads(output.strip().splitlines()[-1]))
        print(
            f"{items:>11,} items: start {results['start_s']:6.1f} s, peak RSS {results['rss_peak_mib'] / 1024:5.2f} GiB "
            f"({results['rss_before_mib'] / 1024:.2f} GiB after imports); per update {results['update_ms_epoch_start']:.3f} ms "
            f"at the epoch's start, {results['update_ms_mid_epoch']:.3f} ms after a resume at update "
            f"{results['updates_per_epoch'] // 2:,} of {results['updates_per_epoch']:,}",
            flush=True,
        )
    for items in args.manifest_items:
        command = [sys.executable, __file__, "--case", "dataset", "--manifest", str(manifest_for(items, args)), "--workers", str(args.workers),
                   "--read_updates", str(args.read_updates), *shared]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        report_dataset(json.loads(output.strip().splitlines()[-1]), args)


if __name__ == "__main__":
    main()
