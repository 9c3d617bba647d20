"""Caching throughput: the full caching path next to the bare VAE + text-encoder calls on the same images.

Tiny mode (default, CPU, offline): builds the tiny SDXL and a folder of random images, then prints
  1. bare encoders: items/s of encode_images + encode_captions alone, on images already decoded and cropped;
  2. full path: items/s of the caching job (reading, hashing, decoding, cropping, encoding, writing
     shards + manifest), and its overhead over (1);
  3. scaling: wall time and items/s of sdxl_process_data_dir.sh with 1 and with 2 workers (process start-up
     and model loading included, as a user sees it).
--full_size: the real-size SDXL VAE (random weights, published architecture) encoding 1024 px images,
bf16 on CUDA (fp32 on CPU, slow): the rate that bounds caching on a GPU.

Run: python benchmarks/bench_caching.py [--num_images 64] [--image_size 512] [--full_size]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

from benchmarks.lib.images import write_captioned_images  # noqa: E402
from sdxl_trainer.config import parse_config  # noqa: E402
from sdxl_trainer.jobs.cache_config import CacheConfig  # noqa: E402
from sdxl_trainer.jobs.cache_job import run_caching
from sdxl_trainer.models.encoders import load_encoders  # noqa: E402
from sdxl_trainer.models.sdxl import build_full_size_vae  # noqa: E402
from sdxl_trainer.models.tiny import save_tiny_pipeline
from sdxl_trainer.preparation.folders import scan_images
from sdxl_trainer.preparation.items import prepare_item, read_source  # noqa: E402


def bare_encoder_rate(pipeline: Path, data_dir: Path, size: int, batch_size: int) -> float:
    encoders = load_encoders(str(pipeline), None, torch.device("cpu"), torch.float32)
    items = [prepare_item(source, *read_source(source), size, size) for source in scan_images(data_dir).pairs]
    encoders.encode_images(items[0].pixels[None])  # warm-up
    started = time.perf_counter()
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        encoders.encode_images(torch.stack([item.pixels for item in batch]))
        encoders.encode_captions([item.caption for item in batch], chunks=1)
    return len(items) / (time.perf_counter() - started)


def full_path_rate(pipeline: Path, data_dir: Path, cache_dir: Path, size: int, batch_size: int, count: int) -> float:
    flags = ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline),
             "--min_resolution", str(size), "--max_resolution", str(size), "--batch_size", str(batch_size), "--items_per_shard", "32"]
    started = time.perf_counter()
    assert run_caching(parse_config(CacheConfig, flags)) == 0
    return count / (time.perf_counter() - started)


def launcher_seconds(pipeline: Path, data_dir: Path, cache_dir: Path, size: int, workers: int) -> float:
    env = dict(os.environ, NUM_WORKERS=str(workers), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", VENV_DIR=str(Path(sys.executable).parent.parent))
    started = time.perf_counter()
    subprocess.run(
        ["bash", str(REPO_ROOT / "sdxl_process_data_dir.sh"), "--data_dir", str(data_dir), "--cache_dir", str(cache_dir),
         "--pretrained_model_name_or_path", str(pipeline), "--min_resolution", str(size), "--max_resolution", str(size), "--items_per_shard", "32"],
        env=env, check=True, capture_output=True,
    )
    return time.perf_counter() - started


def tiny_benchmark(num_images: int, size: int, batch_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pipeline = save_tiny_pipeline(root / "tiny_sdxl")
        write_captioned_images(root / "data", num_images, size)
        bare = bare_encoder_rate(pipeline, root / "data", size, batch_size)
        full = full_path_rate(pipeline, root / "data", root / "cache", size, batch_size, num_images)
        print(f"\ntiny SDXL, CPU ({torch.get_num_threads()} threads), {num_images} images of {size}x{size} px, batch {batch_size}")
        print(f"  bare VAE + text encoders : {bare:7.2f} items/s")
        print(f"  full caching path        : {full:7.2f} items/s  (overhead {100 * (1 - full / bare):.0f}%, model loading included)")
        for workers in (1, 2):
            seconds = launcher_seconds(pipeline, root / "data", root / f"cache_{workers}w", size, workers)
            print(f"  launcher, {workers} worker(s)     : {seconds:6.1f} s wall, {num_images / seconds:6.2f} items/s (process start-up included)")


def full_size_benchmark(batch_size: int, steps: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae = build_full_size_vae().to(device, dtype).eval().requires_grad_(False)
    pixels = torch.rand(batch_size, 3, 1024, 1024, device=device, dtype=dtype) * 2 - 1

    def encode() -> None:
        vae.encode(pixels).latent_dist.mean.float().cpu()  # .cpu() waits for the GPU, as the cache writer does

    with torch.no_grad():
        encode()  # warm-up (cuDNN algorithm choice)
        started = time.perf_counter()
        for _ in range(steps):
            encode()
        elapsed = time.perf_counter() - started
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    memory = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    print(f"full-size SDXL VAE encode, 1024x1024, {str(dtype).removeprefix('torch.')}, batch {batch_size} on {name}: "
          f"{steps * batch_size / elapsed:.2f} images/s{memory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_images", type=int, default=64, help="images in the tiny benchmark (default 64)")
    parser.add_argument("--image_size", type=int, default=512, help="side of the square test images and their bucket, px (default 512)")
    parser.add_argument("--batch_size", type=int, default=8, help="images per encoder call (default 8)")
    parser.add_argument("--full_size", action="store_true", help="benchmark the real-size SDXL VAE at 1024 px instead")
    parser.add_argument("--steps", type=int, default=10, help="timed batches in --full_size mode (default 10)")
    args = parser.parse_args()
    if args.full_size:
        full_size_benchmark(args.batch_size, args.steps)
    else:
        tiny_benchmark(args.num_images, args.image_size, args.batch_size)


if __name__ == "__main__":
    main()
