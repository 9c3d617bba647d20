"""FSDP2 on 2 CPU processes (gloo): each rank holds half the UNet, and training gives the same weights
as 1 process on the same data (same global batch, same seed) within fp32 tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import MAX_RESOLUTION, MIN_RESOLUTION, REPO_ROOT, run_processes


def test_each_rank_holds_half_of_the_unet(tmp_path, tiny_pipeline_dir):
    run_processes(2, REPO_ROOT / "tests" / "fsdp_shard_worker.py", [str(tiny_pipeline_dir), str(tmp_path)])
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    full_bytes = reports[0]["full_bytes"]
    assert all(report["all_dtensor"] and report["placements"] == ["(Shard(dim=0),)"] for report in reports)
    shares = [report["local_bytes"] / full_bytes for report in reports]
    # Dim-0 sharding pads odd-sized rows, so a rank may hold a little more than exactly half.
    assert all(0.45 <= share <= 0.55 for share in shares), shares
    assert abs(sum(report["local_bytes"] for report in reports) - full_bytes) / full_bytes < 0.02
    print(f"per-rank parameter share: {shares}")


def _train(num_processes: int, per_rank_batch: int, cache_dir: Path, pipeline_dir: Path, output_dir: Path) -> dict[str, torch.Tensor]:
    run_processes(
        num_processes,
        REPO_ROOT / "sdxl_FSDP_train.py",
        [
            "--cached_dataset_dirs", str(cache_dir),
            "--pretrained_model_name_or_path", str(pipeline_dir),
            "--min_resolution", str(MIN_RESOLUTION), "--max_resolution", str(MAX_RESOLUTION),
            "--train_batch_size", str(per_rank_batch),
            "--gradient_accumulation_steps", "2",
            "--num_train_epochs", "1",
            "--optimizer", "adamw", "--learning_rate", "1e-4", "--mixed_precision", "fp32",
            "--conditional_dropout_percent", "0.5",
            "--dataloader_num_workers", "0",
            "--set_seed", "7",
            "--save_precision", "fp32",
            "--output_dir", str(output_dir), "--project_name", "run",
        ],
    )
    return load_file(output_dir / "run" / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")


def test_two_processes_train_like_one(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    base = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    one = _train(1, 2, sample_cache_dir, tiny_pipeline_dir, tmp_path / "one")
    two = _train(2, 1, sample_cache_dir, tiny_pipeline_dir, tmp_path / "two")
    assert one.keys() == two.keys() == base.keys()
    moved = max((one[key] - base[key]).abs().max().item() for key in base)
    differs = max((one[key] - two[key]).abs().max().item() for key in base)
    print(f"largest weight change from training: {moved:.3e}; largest 1-vs-2-process difference: {differs:.3e}")
    assert moved > 1e-4  # training really changed the weights (several updates at lr 1e-4)
    assert differs < 1e-5, f"1 and 2 processes diverged by {differs}"
