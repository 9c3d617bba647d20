"""Run under torchrun (2 CPU processes) by test_train_step_distributed.py. Writes rank{N}.json with:
- per optimizer: the largest difference between "2 updates straight" and "1 update, save, restore into a
  fresh model and optimizer, 1 update", and the bytes of parameters and optimizer state this rank holds;
- reduce-scatter counts of one update with 1 and with 3 microbatches (reduced once, and every microbatch);
  all-reduces of one Adafactor and one CAME step;
- per factored optimizer (Adafactor, CAME): the largest difference between weights stepped as shards
  (uneven ones, and an empty one on rank 1) and the same weights stepped whole in one process;
- the share of the EMA this rank holds;
- the largest change of each UNet block's weights after one AdamW update with a param group of FSDP2 shards per
  block (--block_lr's groups), two blocks frozen before sharding."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from unet_batches import (
    TINY_BLOCK_RATES, clipping_against_torch, largest_change_per_block, make_train_step, save_training_state, saved_state_of, synthetic_batch,
)

from sdxl_trainer.distributed.fsdp import local_parameter_bytes, shard_unet
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer, local_optimizer_state_bytes
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.training.block_rates import freeze_zero_rate_blocks
from sdxl_trainer.training.ema import ShardedEMA

# Prodigy's multiplies the step size it estimates (1.0 is its own value).
LEARNING_RATES = {"adamw8bit": 1e-3, "adamw": 1e-3, "adafactor": 1e-3, "lion": 1e-4, "came": 1e-4, "prodigy": 1.0, "adamw_schedulefree": 1e-3}
FACTORED_OPTIMIZERS = ("adafactor", "came")


def sharded_unet(pipeline_dir: Path, world, weights_dtype: torch.dtype = torch.float32) -> UNet2DConditionModel:
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet", dtype=weights_dtype)
    shard_unet(unet, world.mesh, param_dtype=None if weights_dtype == torch.float32 else weights_dtype)
    return unet


def rank_batch(unet, world, update: int) -> list[dict[str, torch.Tensor]]:
    # 2 items per rank per update, different on each rank and each update; 16x16 latents, as what these
    # workers check (steps, saves, restores, layouts) does not depend on the size: 32x24 took twice the CPU
    return [synthetic_batch(unet, [100 * update + 2 * world.rank, 100 * update + 2 * world.rank + 1], seed=update, height=16, width=16)]


def full_weights(unet) -> dict[str, torch.Tensor]:
    return {name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()).clone() for name, parameter in unet.named_parameters()}


def optimizer_round_trip(name: str, pipeline_dir: Path, checkpoint_dir: Path, world, weights_dtype: torch.dtype = torch.float32) -> dict:
    def fresh():
        unet = sharded_unet(pipeline_dir, world, weights_dtype)
        optimizer = build_optimizer(name, unet.parameters(), LEARNING_RATES[name], 1e-2, (0.9, None), 1e-8)
        return unet, optimizer, make_train_step(unet, optimizer, pipeline_dir)

    unet, optimizer, step = fresh()
    first = step(rank_batch(unet, world, 0), epoch=0)
    save_training_state(checkpoint_dir, unet, optimizer, None, *saved_state_of(step, "adamw", world.world_size))
    step(rank_batch(unet, world, 1), epoch=0)
    straight = full_weights(unet)
    report = {"local_param_bytes": local_parameter_bytes(unet), "local_state_bytes": local_optimizer_state_bytes(optimizer)}

    unet, optimizer, step = fresh()
    trainer_state, _ = load_training_state(checkpoint_dir, unet, optimizer, None)
    step(rank_batch(unet, world, 1), epoch=0)
    resumed = full_weights(unet)
    report["max_difference"] = max((straight[key] - resumed[key]).abs().max().item() for key in straight)
    report["first_loss"] = first.loss
    report["restored_update"] = trainer_state.update
    return report


class DispatchedOps(TorchDispatchMode):
    """Counts the ops dispatched under it by name (e.g. "c10d::allreduce_"); the profiler took seconds to
    list the events of one train step."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def reduce_scatters_per_update(pipeline_dir: Path, world, microbatches: int, every_microbatch: bool = False) -> tuple[int, dict]:
    """How many reduce-scatters one update of `microbatches` makes, and the weights after it (SGD, lr 1)."""
    unet = sharded_unet(pipeline_dir, world)
    optimizer = torch.optim.SGD(unet.parameters(), lr=1.0)
    step = make_train_step(unet, optimizer, pipeline_dir)
    step.reduce_every_microbatch = every_microbatch
    batches = [synthetic_batch(unet, [10 * micro + world.rank], seed=1) for micro in range(microbatches)]
    with DispatchedOps() as dispatched:
        step(batches, epoch=0)
    return dispatched.counts["c10d::_reduce_scatter_base_"], full_weights(unet)


def all_reduces_per_step(name: str, pipeline_dir: Path, world) -> int:
    """How many all-reduces one step of optimizer `name` over the sharded UNet's 212 parameters makes (its state exists)."""
    unet = sharded_unet(pipeline_dir, world)
    optimizer = build_optimizer(name, unet.parameters(), 1e-3, 0.0, (0.9, None), 1e-8)
    for parameter in unet.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    with DispatchedOps() as dispatched:
        optimizer.step()
    return dispatched.counts["c10d::allreduce_"]


def shards_against_whole(name: str, world) -> float:
    """Four steps of optimizer `name` on dim-0 shards of a linear weight and bias, a conv kernel, weights whose
    rows do not split evenly and a one-row weight (rank 1's shard of it is empty), against the same steps on
    the whole tensors in this process: the largest difference, relative to the largest weight."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (24,), (6, 4, 3, 3), (5, 7), (1, 8), (3,)]
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    gradients = [[torch.randn(shape, generator=generator) * (step + 1) for shape in shapes] for step in range(4)]

    def stepped(layout) -> list[torch.Tensor]:
        parameters = [torch.nn.Parameter(layout(weight.clone())) for weight in weights]
        optimizer = build_optimizer(name, parameters, 1e-2, 1e-2, (0.9, None), 1e-8)
        for step_gradients in gradients:
            for parameter, gradient in zip(parameters, step_gradients):
                parameter.grad = layout(gradient.clone())
            optimizer.step()
        return [parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach() for parameter in parameters]

    sharded = stepped(lambda tensor: distribute_tensor(tensor, world.mesh, [Shard(0)]))
    whole = stepped(lambda tensor: tensor)
    assert all(not torch.equal(weight, start) for weight, start in zip(whole, weights))
    scale = max(weight.abs().max().item() for weight in weights)
    return max((a - b).abs().max().item() for a, b in zip(sharded, whole)) / scale


def block_rate_changes(pipeline_dir: Path, world) -> list[float]:
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    freeze_zero_rate_blocks(unet, TINY_BLOCK_RATES)
    shard_unet(unet, world.mesh, param_dtype=None)
    return largest_change_per_block(unet, pipeline_dir, TINY_BLOCK_RATES, rank_batch(unet, world, 0)[0])


def main(pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    pipeline, output = Path(pipeline_dir), Path(output_dir)
    report: dict = {"optimizers": {}}
    for name in OPTIMIZERS:
        report["optimizers"][name] = optimizer_round_trip(name, pipeline, output / f"checkpoint_{name}", world)
    # bf16 weights with stochastic rounding, through the 8-bit step (uneven shards: small ones keep fp32 moments)
    report["bf16_weights"] = optimizer_round_trip("adamw8bit", pipeline, output / "checkpoint_bf16", world, torch.bfloat16)
    report["all_reduces"] = {name: all_reduces_per_step(name, pipeline, world) for name in FACTORED_OPTIMIZERS}
    report["shards_against_whole"] = {name: shards_against_whole(name, world) for name in FACTORED_OPTIMIZERS}
    single, _ = reduce_scatters_per_update(pipeline, world, 1)
    once, once_weights = reduce_scatters_per_update(pipeline, world, 3)
    every, every_weights = reduce_scatters_per_update(pipeline, world, 3, every_microbatch=True)
    report["reduce_scatters"] = {"1": single, "3": once}
    report["reduce_every_microbatch"] = {
        "once": once,
        "every": every,
        "weights_max_difference": max((once_weights[key] - every_weights[key]).abs().max().item() for key in once_weights),
    }
    unet = sharded_unet(pipeline, world)
    ema = ShardedEMA(unet, decay=0.9, on_cpu=True)
    report["ema_local_bytes"] = sum(shadow.numel() * shadow.element_size() for shadow in ema.shadow)
    report["param_local_bytes"] = local_parameter_bytes(unet)
    report["clipping"] = clipping_against_torch(unet, seed=world.rank)
    report["block_rate_changes"] = block_rate_changes(pipeline, world)
    (output / f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
