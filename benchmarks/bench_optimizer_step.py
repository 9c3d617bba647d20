"""Optimizer step time over the FSDP2-sharded tiny UNet's parameters, for every optimizer (and torch's own
AdamW, fused over DTensors and as a for-loop, and torchao's own per-tensor AdamW8bit, which ours
replaced), and the gradient clipping before it (the trainer's clip_gradients on local shards against torch's
clip_grad_norm_), measured side by side in one process run. Prints figures.

    venv/bin/python benchmarks/bench_optimizer_step.py            # 1 process
    venv/bin/torchrun --nproc_per_node 2 benchmarks/bench_optimizer_step.py
    venv/bin/python benchmarks/bench_optimizer_step.py --sdxl_tensor_count [--sharded]

--sdxl_tensor_count steps over as many parameter tensors as the full-size SDXL UNet has (1,680: 864 of at
least 4,096 values, which the 8-bit optimizers keep in 8 bits, and 816 smaller), each small, once at
4,096 / 320 values and once at twice that: the difference is the cost of the values, the rest the cost per
tensor that a faster device does not remove (Python, dispatch, kernel launches), which every rank pays
for all 1,680 tensors however many ranks share the UNet. The first step's time (kernels compiled, or
loaded from the compile cache) is printed too. With --sharded those tensors are DTensor shards (dim 0 split
over the processes), as FSDP2 hands them to the optimizer: the cost per tensor then includes what DTensor
costs an optimizer that steps through it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the trainer's package and benchmarks.lib

from diffusers import UNet2DConditionModel  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402
from torchao.optim import AdamW8bit as TorchaoAdamW8bit  # noqa: E402

from benchmarks.lib.timing import time_steps  # noqa: E402
from sdxl_trainer.distributed.fsdp import shard_unet  # noqa: E402
from sdxl_trainer.distributed.world import World, init_distributed, shutdown_distributed  # noqa: E402
from sdxl_trainer.models.tiny import save_tiny_pipeline  # noqa: E402
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer  # noqa: E402
from sdxl_trainer.training.gradient_norm import clip_gradients  # noqa: E402

WARMUP_STEPS, MEASURED_STEPS = 3, 20
SDXL_TENSORS = {4096: 864, 320: 816}  # values per tensor -> count, standing in for the full-size UNet's 1,680 tensors
FOR_LOOP_ADAMW = "adamw, for-loop (torch's default on CPU)"
TORCH_FUSED_ADAMW = "adamw, torch's fused step on DTensors"
TORCHAO_ADAMW8BIT = "adamw8bit, torchao's per-tensor step"
OUR_CLIPPING = "clipping: clip_gradients (local shards)"
TORCH_CLIPPING = "clipping: torch's clip_grad_norm_"
SETTINGS = dict(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)


def seconds(call: Callable[[], object], world: World) -> tuple[float, float]:
    """(first call, mean of the measured calls) in seconds, of the slowest rank; the first compiles the 8-bit
    kernels. The ranks start together: a collective in the call would otherwise time the other rank's lag."""
    (times,) = time_steps({"call": lambda _: call()}, WARMUP_STEPS, MEASURED_STEPS, 1, world).values()
    return times.first_step_seconds, times.seconds_per_step


def every_optimizer(parameters: list[torch.nn.Parameter], world: World) -> dict[str, tuple[float, float]]:
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    results = {}
    for name in OPTIMIZERS:
        results[name] = seconds(build_optimizer(name, parameters, SETTINGS["lr"], 0.0, (0.9, None), 1e-8).step, world)
    results[TORCHAO_ADAMW8BIT] = seconds(TorchaoAdamW8bit(parameters, **SETTINGS).step, world)
    results[FOR_LOOP_ADAMW] = seconds(torch.optim.AdamW(parameters, **SETTINGS, foreach=False).step, world)
    results[TORCH_FUSED_ADAMW] = seconds(torch.optim.AdamW(parameters, **SETTINGS, fused=True).step, world)
    results[OUR_CLIPPING] = seconds(lambda: clip_gradients(parameters, 1.0), world)
    results[TORCH_CLIPPING] = seconds(lambda: torch.nn.utils.clip_grad_norm_(parameters, 1.0), world)
    return results


def tiny_unet_parameters(world) -> tuple[list[torch.nn.Parameter], str]:
    with tempfile.TemporaryDirectory() as folder:
        pipeline = save_tiny_pipeline(Path(folder) / "tiny", seed=0)
        unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=None)
    return list(unet.parameters()), "tiny UNet, sharded with FSDP2"


def sdxl_count_parameters(size_factor: int, mesh=None) -> list[torch.nn.Parameter]:
    """SDXL_TENSORS' tensors of size_factor times their size; DTensor shards over `mesh` when given."""
    torch.manual_seed(0)
    tensors = [torch.randn(size * size_factor) for size, count in SDXL_TENSORS.items() for _ in range(count)]
    if mesh is not None:
        tensors = [distribute_tensor(tensor, mesh, [Shard(0)]) for tensor in tensors]
    return [torch.nn.Parameter(tensor) for tensor in tensors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdxl_tensor_count", action="store_true", help="1,680 small tensors (SDXL's count) instead of the tiny UNet")
    parser.add_argument("--sharded", action="store_true", help="with --sdxl_tensor_count: DTensor shards, as FSDP2 gives them")
    args = parser.parse_args()
    world = init_distributed()
    if args.sdxl_tensor_count:
        mesh = world.mesh if args.sharded else None
        parameters = sdxl_count_parameters(1, mesh)
        results, doubled = every_optimizer(parameters, world), every_optimizer(sdxl_count_parameters(2, mesh), world)
        what = f"as many tensors as SDXL's UNet, each small, {'DTensor shards' if args.sharded else 'not sharded'}"
    else:
        parameters, what = tiny_unet_parameters(world)
        results, doubled = every_optimizer(parameters, world), None
    if world.is_main:
        print(f"optimizer step over {len(parameters)} parameter tensors ({what}), {world.world_size} process(es):")
        for name, (first, seconds) in results.items():
            line = f"  {name:40s} {seconds * 1e3:8.1f} ms (first step {first:5.2f} s)"
            if doubled is not None:  # step time = per-tensor cost + cost of the values, which doubling the values doubles
                per_tensor = (2 * seconds - doubled[name][1]) / len(parameters)
                line += f", {doubled[name][1] * 1e3:8.1f} ms at twice the values: {per_tensor * 1e6:6.1f} us per tensor"
            print(line)
        print(f"  adamw: the fused step is {results[FOR_LOOP_ADAMW][1] / results['adamw'][1]:.2f}x faster than the for-loop")
        print(f"  adamw: its first step takes {results['adamw'][0]:.2f} s on local shards, {results[TORCH_FUSED_ADAMW][0]:.2f} s through torch's AdamW (DTensor's sharding rules)")
        print(f"  adamw8bit: ours is {results[TORCHAO_ADAMW8BIT][1] / results['adamw8bit'][1]:.2f}x faster than torchao's per-tensor step")
        print(f"  clipping: ours is {results[TORCH_CLIPPING][1] / results[OUR_CLIPPING][1]:.2f}x faster than torch's clip_grad_norm_")
    shutdown_distributed()


if __name__ == "__main__":
    main()
