"""Optimizer step time over the FSDP2-sharded tiny UNet's parameters, for every optimizer (and AdamW with
and without torch's multi-tensor path), measured side by side in one process run. Prints figures.

    venv/bin/python benchmarks/bench_optimizer_step.py            # 1 process
    venv/bin/torchrun --nproc_per_node 2 benchmarks/bench_optimizer_step.py
    venv/bin/python benchmarks/bench_optimizer_step.py --sdxl_tensor_count

--sdxl_tensor_count steps over as many parameter tensors as the full-size SDXL UNet has (1,680: 864 of at
least 4,096 values, which torchao keeps in 8 bits, and 816 smaller), each small (4,096 / 320 values): the
cost per tensor that does not shrink with a faster device (Python, dispatch, kernel launches).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffusers import UNet2DConditionModel  # noqa: E402

from sdxl_trainer.optimizers import OPTIMIZERS, build_optimizer  # noqa: E402
from sdxl_trainer.parallel import init_distributed, shard_unet, shutdown_distributed  # noqa: E402
from sdxl_trainer.tiny_model import save_tiny_pipeline  # noqa: E402

WARMUP_STEPS, MEASURED_STEPS = 3, 20
SDXL_TENSORS = {4096: 864, 320: 816}  # values per tensor -> count, standing in for the full-size UNet's 1,680 tensors
FOR_LOOP_ADAMW = "adamw, for-loop (torch's default on CPU)"


def step_seconds(optimizer: torch.optim.Optimizer) -> float:
    for _ in range(WARMUP_STEPS):  # torchao compiles its step here
        optimizer.step()
    started = time.perf_counter()
    for _ in range(MEASURED_STEPS):
        optimizer.step()
    return (time.perf_counter() - started) / MEASURED_STEPS


def tiny_unet_parameters(world) -> tuple[list[torch.nn.Parameter], str]:
    with tempfile.TemporaryDirectory() as folder:
        pipeline = save_tiny_pipeline(Path(folder) / "tiny", seed=0)
        unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=None)
    return list(unet.parameters()), "tiny UNet, sharded with FSDP2"


def sdxl_count_parameters() -> tuple[list[torch.nn.Parameter], str]:
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(size)) for size, count in SDXL_TENSORS.items() for _ in range(count)]
    return parameters, "as many tensors as SDXL's UNet, each small, not sharded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdxl_tensor_count", action="store_true", help="1,680 small tensors (SDXL's count) instead of the tiny UNet")
    args = parser.parse_args()
    world = init_distributed()
    parameters, what = sdxl_count_parameters() if args.sdxl_tensor_count else tiny_unet_parameters(world)
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    results = {}
    for name in OPTIMIZERS:
        results[name] = step_seconds(build_optimizer(name, parameters, 1e-6, 0.0, (0.9, None), 1e-8))
    results[FOR_LOOP_ADAMW] = step_seconds(torch.optim.AdamW(parameters, lr=1e-6, foreach=False))
    if world.is_main:
        print(f"optimizer step over {len(parameters)} parameter tensors ({what}), {world.world_size} process(es):")
        for name, seconds in results.items():
            print(f"  {name:42s} {seconds * 1e3:8.1f} ms  ({seconds / len(parameters) * 1e6:7.1f} us per tensor)")
        print(f"  adamw: the multi-tensor path is {results[FOR_LOOP_ADAMW] / results['adamw']:.2f}x faster than the for-loop")
    shutdown_distributed()


if __name__ == "__main__":
    main()
