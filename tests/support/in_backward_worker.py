"""Run under torchrun (2 CPU processes) by test_in_backward_distributed.py: the optimizer in backward over FSDP2
shards of the tiny UNet (a hook per sharded parameter, fired after each unit's reduce-scatter). Writes
rank{N}.json with, per optimizer it accepts:
- the largest difference between the full weights after 2 ordinary updates and after 2 updates in backward
  (one microbatch, no clipping), and both runs' logged losses;
- the largest difference between 2 updates in backward straight and 1 update, save, restore into a fresh
  model and optimizer, 1 update;
- whether any sharded parameter held a gradient after an update in backward, and the most gradient bytes this
  rank held at once in backward against its shards' bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from torch.distributed.tensor import DTensor
from unet_batches import make_train_step, save_training_state, saved_state_of, synthetic_batch

from sdxl_trainer.distributed.fsdp import shard_unet
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.optimizers.build import IN_BACKWARD_REFUSED, OPTIMIZERS, build_optimizer
from sdxl_trainer.state.load import load_training_state

LEARNING_RATES = {"adamw8bit": 1e-3, "adamw": 1e-3, "adafactor": 1e-3, "lion": 1e-4, "came": 1e-4}


def rank_batch(unet, world, update: int) -> list[dict[str, torch.Tensor]]:
    return [synthetic_batch(unet, [100 * update + 2 * world.rank, 100 * update + 2 * world.rank + 1], seed=update, height=16, width=16)]


def full_weights(unet) -> dict[str, torch.Tensor]:
    return {name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()).clone() for name, parameter in unet.named_parameters()}


def largest_difference(first: dict, second: dict) -> float:
    return max((first[key] - second[key]).abs().max().item() for key in first)


def fresh(name: str, pipeline_dir: Path, world, in_backward: bool):
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=None)
    optimizer = build_optimizer(name, unet.parameters(), LEARNING_RATES[name], 1e-2, (0.9, None), 1e-8)
    return unet, optimizer, make_train_step(unet, optimizer, pipeline_dir, max_grad_norm=0.0, optimizer_in_backward=in_backward)


def local_grad_bytes(parameters: list[torch.nn.Parameter]) -> int:
    return sum(parameter.grad.to_local().numel() * parameter.grad.to_local().element_size() for parameter in parameters if parameter.grad is not None)


def report_for(name: str, pipeline_dir: Path, checkpoint_dir: Path, world) -> dict:
    unet, _, step = fresh(name, pipeline_dir, world, in_backward=False)
    ordinary_losses = [step(rank_batch(unet, world, update), epoch=0).loss for update in range(2)]
    ordinary = full_weights(unet)

    unet, optimizer, step = fresh(name, pipeline_dir, world, in_backward=True)
    parameters = list(unet.parameters())
    peak = [0]
    for parameter in parameters:  # after the optimizer in backward's hooks: what it left held
        parameter.register_post_accumulate_grad_hook(lambda _parameter: peak.__setitem__(0, max(peak[0], local_grad_bytes(parameters))))
    losses = [step(rank_batch(unet, world, 0), epoch=0).loss]
    grads_left = any(parameter.grad is not None for parameter in parameters)
    save_training_state(checkpoint_dir, unet, optimizer, None, *saved_state_of(step, name, world.world_size))
    losses.append(step(rank_batch(unet, world, 1), epoch=0).loss)
    grads_left = grads_left or any(parameter.grad is not None for parameter in parameters)
    straight = full_weights(unet)

    unet, optimizer, step = fresh(name, pipeline_dir, world, in_backward=True)
    load_training_state(checkpoint_dir, unet, optimizer, None)
    step(rank_batch(unet, world, 1), epoch=0)
    return {
        "against_ordinary": largest_difference(ordinary, straight),
        "ordinary_losses": ordinary_losses,
        "losses": losses,
        "resumed_against_straight": largest_difference(straight, full_weights(unet)),
        "grads_left": grads_left,
        "peak_grad_bytes": peak[0],
        "local_param_bytes": sum(parameter.to_local().numel() * parameter.to_local().element_size() for parameter in parameters),
    }


def main(pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    output = Path(output_dir)
    report = {name: report_for(name, Path(pipeline_dir), output / f"checkpoint_{name}", world) for name in OPTIMIZERS if name not in IN_BACKWARD_REFUSED}
    (output / f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
