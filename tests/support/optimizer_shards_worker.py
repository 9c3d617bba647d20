"""Run under the launcher by test_optimizer_shards.py (2 CPU processes): Prodigy and schedule-free AdamW stepped
on FSDP2's dim-0 shards of the same weights and gradients that one process steps whole, and the host work of
one sharded step of each. Writes OUTPUT_DIR/rank<R>.json.

    optimizer_shards_worker.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.estimates.host_work import HostWork
from sdxl_trainer.optimizers.build import build_optimizer
from sdxl_trainer.optimizers.prodigy import D, SHARED

# Rows split evenly, unevenly (3 and 2), and one row (rank 1 holds none of it); a bias; a conv kernel.
SHAPES = [(24, 16), (5, 3), (1, 7), (24,), (6, 4, 3, 3)]
UPDATES = 10
RATES = {"prodigy": 1.0, "adamw_schedulefree": 1e-2}


def rate(update: int, peak: float) -> float:
    return peak * min(1.0, update / 3)  # a warm-up from 0, as the trainer's


def train(name: str, weights: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.optim.Optimizer:
    """UPDATES updates on |w - target|^2, whose gradients point one way for long (Prodigy's d grows)."""
    optimizer = build_optimizer(name, weights, RATES[name], 0.01, (0.9, None), 1e-8)
    for update in range(UPDATES):
        for weight, target in zip(weights, targets):
            weight.grad = 2 * (weight.detach() - target)
        for group in optimizer.param_groups:
            group["lr"] = rate(update, RATES[name])
        optimizer.step()
    return optimizer


def full(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A local shard laid out as `like` (a DTensor parameter), gathered whole."""
    return DTensor.from_local(tensor, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()).full_tensor()


def main(output_dir: str) -> None:
    world = init_distributed()
    generator = torch.Generator().manual_seed(0)
    starts = [torch.randn(shape, generator=generator) for shape in SHAPES]
    targets = [torch.randn(shape, generator=generator) for shape in SHAPES]
    report = {}
    for name in RATES:
        whole = [torch.nn.Parameter(start.clone()) for start in starts]
        whole_optimizer = train(name, whole, targets)
        sharded = [torch.nn.Parameter(distribute_tensor(start.clone(), world.mesh, [Shard(0)])) for start in starts]
        sharded_targets = [distribute_tensor(target, world.mesh, [Shard(0)]) for target in targets]
        optimizer = train(name, sharded, sharded_targets)
        result = {
            "moved": max((weight.detach() - start).abs().max().item() for weight, start in zip(whole, starts)),
            "max_difference": max((weight.full_tensor() - expected.detach()).abs().max().item() for weight, expected in zip(sharded, whole)),
        }
        if name == "prodigy":
            result["d"] = optimizer.state[sharded[0]][SHARED][D].item()
            result["d_one_process"] = whole_optimizer.state[whole[0]][SHARED][D].item()
        else:
            evaluated = [full(local, parameter) for local, parameter in zip(optimizer.evaluation_weights(sharded), sharded)]
            expected = whole_optimizer.evaluation_weights(whole)
            result["evaluation_max_difference"] = max((a - b).abs().max().item() for a, b in zip(evaluated, expected))
        # One more sharded step, its host work counted: reads of device values, and collectives by kind.
        for weight, target in zip(sharded, sharded_targets):
            weight.grad = 2 * (weight.detach() - target)
        with HostWork(by_part=False) as counts:
            optimizer.step()
        result["host_reads"] = counts.total_reads
        result["all_reduces"] = counts.calls("all_reduce")
        result["other_collectives"] = sum(counts.calls(kind) for kind in ("all_gather", "reduce_scatter", "broadcast", "barrier"))
        report[name] = result
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
