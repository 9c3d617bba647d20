"""Per-rank memory of FSDP2 training state: bytes of parameters + gradients + optimizer state that each
rank holds with 1 process and with 2 processes (CPU, gloo), for every optimizer.

    venv/bin/python benchmarks/bench_memory.py [--pipeline DIR] [--full_size]

Without --pipeline a tiny SDXL pipeline is built in a temp folder; --full_size uses SDXL's real UNet
config with random weights (about 10 GB of fp32 parameters per process on 1 process: needs RAM).
Target (issue 4): 2-process per-rank bytes at most 0.55x of 1 process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

from benchmarks.lib.processes import cpu_env, launch_command  # noqa: E402


def worker(pipeline_dir: str, full_size: bool, output_dir: str) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.distributed.fsdp import local_parameter_bytes, shard_unet
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
    from sdxl_trainer.models.sdxl import build_full_size_unet
    from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer, local_optimizer_state_bytes

    world = init_distributed()
    report = {}
    for name in OPTIMIZERS:
        unet = build_full_size_unet() if full_size else UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
        shard_unet(unet, world.mesh, param_dtype=None)
        optimizer = build_optimizer(name, unet.parameters(), 1e-5, 0.0, (0.9, 0.99), 1e-8)
        for parameter in unet.parameters():  # a gradient of the parameter's own layout, as backward leaves it
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        parameter_bytes = local_parameter_bytes(unet)
        report[name] = {"parameters": parameter_bytes, "gradients": parameter_bytes, "optimizer": local_optimizer_state_bytes(optimizer)}
        del unet, optimizer
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


def launch(processes: int, pipeline_dir: Path, full_size: bool, output_dir: Path) -> list[dict]:
    output_dir.mkdir(parents=True, exist_ok=True)
    worker_args = ["--worker", "--pipeline", str(pipeline_dir), "--output", str(output_dir)] + (["--full_size"] if full_size else [])
    subprocess.run(launch_command(processes, __file__, worker_args), check=True, env=cpu_env(), stdout=subprocess.DEVNULL)
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", type=Path, help="diffusers SDXL folder (default: build the tiny one)")
    parser.add_argument("--full_size", action="store_true", help="SDXL's real UNet size, random weights")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(str(args.pipeline), args.full_size, args.output)
        return
    with tempfile.TemporaryDirectory() as tmp:
        pipeline_dir = args.pipeline
        if pipeline_dir is None:
            from sdxl_trainer.models.tiny import save_tiny_pipeline

            pipeline_dir = save_tiny_pipeline(Path(tmp) / "tiny_sdxl", seed=0)
        one = launch(1, pipeline_dir, args.full_size, Path(tmp) / "one")
        two = launch(2, pipeline_dir, args.full_size, Path(tmp) / "two")
    print(f"{'optimizer':<10} {'1 process (MiB)':>16} {'2 processes, per rank (MiB)':>30} {'ratio':>7}")
    for name in one[0]:
        single = sum(one[0][name].values())
        per_rank = [sum(report[name].values()) for report in two]
        print(f"{name:<10} {single / 2**20:>16.2f} {' / '.join(f'{value / 2**20:.2f}' for value in per_rank):>30} {max(per_rank) / single:>7.3f}")
    print("bytes = parameters + gradients + optimizer state held by the rank (fp32 master weights; target ratio <= 0.55)")
    print("optimizer state alone, 1 process vs 2 processes per rank (MiB):")
    for name in one[0]:
        per_rank = " / ".join(f"{report[name]['optimizer'] / 2**20:.3f}" for report in two)
        print(f"  {name:<10} {one[0][name]['optimizer'] / 2**20:.3f} vs {per_rank}")


if __name__ == "__main__":
    main()
