"""Run under the launcher by test_speed_estimate.py: the tiny UNet, sharded with the trainer's shard_unet (over
all ranks, and as HSDP in replicate groups), trains one update of 2 microbatches through TrainStep per
layout of its collectives (and --reduce_dtype bf16), while CollectiveBytes counts what they move. Writes rank{N}.json: per replicate
group count and layout, the bytes and calls by kind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from train_step_worker import rank_batch
from unet_batches import make_train_step

from sdxl_trainer.distributed.fsdp import shard_unet
from sdxl_trainer.distributed.world import device_mesh, init_distributed, shutdown_distributed
from sdxl_trainer.estimates.collective_count import CollectiveBytes
from sdxl_trainer.optimizers.build import build_optimizer

LAYOUTS = {  # name: (reshard_after_forward, reduce_every_microbatch, reduce_dtype)
    "full_shard_reduce_every_microbatch": (True, True, torch.float32),
    "full_shard_reduce_once": (True, False, torch.float32),
    "shard_grad_op_reduce_once": (False, False, torch.float32),
    "full_shard_reduce_every_microbatch_in_bf16": (True, True, torch.bfloat16),
}


def main(pipeline_dir: str, output_dir: str, replicate_groups: str) -> None:
    """replicate_groups: comma-separated group counts to run, 1 for full sharding over every rank."""
    world = init_distributed()
    report: dict = {}
    for groups in replicate_groups.split(","):
        mesh = device_mesh(world.device.type, world.world_size, int(groups))
        report[groups] = {name: counted_update(pipeline_dir, world, mesh, *layout) for name, layout in LAYOUTS.items()}
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


def counted_update(pipeline_dir: str, world, mesh, reshard_after_forward: bool, reduce_every_microbatch: bool, reduce_dtype: torch.dtype) -> dict:
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    shard_unet(unet, mesh, param_dtype=None, reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype)
    optimizer = build_optimizer("adamw", unet.parameters(), 1e-4, 1e-2, (0.9, None), 1e-8)
    step = make_train_step(unet, optimizer, Path(pipeline_dir), reduce_every_microbatch=reduce_every_microbatch,
                           gather_once_per_update=not reshard_after_forward)  # as the trainer builds it
    microbatches = rank_batch(unet, world, 0) + rank_batch(unet, world, 1)
    with CollectiveBytes() as counted:
        step(microbatches, epoch=0)
    return {"bytes": counted.bytes, "calls": counted.calls}


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
