"""Run under torchrun (4 CPU processes) by test_hsdp.py. The tiny UNet trains 2 updates on the same global
batches with full sharding over the 4 ranks and with HSDP (2 replicated groups of 2, --replicate_groups 2),
per optimizer. With 8-bit AdamW, HSDP saves its state after the first update (written by writer processes, as
a background save is: they rebuild the 2-D mesh), and that state is resumed both as HSDP and as full sharding
(AdamW's moments are laid out as the weights, which every resume compares).
Writes rank{N}.json with, per optimizer: the largest weight differences (HSDP against full sharding; for
8-bit AdamW, HSDP resumed against HSDP straight and resumed across layouts against HSDP straight), this
rank's local parameter bytes under each layout, and a checksum of its local shards (equal within a replica
pair)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from train_step_worker import full_weights, rank_batch  # the same global batch in every layout
from unet_batches import clipping_against_torch, make_train_step, save_training_state_by_writer_process, saved_state_of

from sdxl_trainer.distributed.fsdp import local_parameter_bytes, shard_unet
from sdxl_trainer.distributed.world import device_mesh, init_distributed, shutdown_distributed
from sdxl_trainer.optimizers.build import build_optimizer
from sdxl_trainer.state.load import load_training_state

GROUPS = 2
OPTIMIZER_NAMES = ("adamw", "adamw8bit")
RESUMED_OPTIMIZER = "adamw8bit"


def fresh(pipeline_dir: Path, mesh, optimizer_name: str):
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    shard_unet(unet, mesh, param_dtype=None)
    optimizer = build_optimizer(optimizer_name, unet.parameters(), 1e-3, 1e-2, (0.9, None), 1e-8)
    return unet, optimizer, make_train_step(unet, optimizer, pipeline_dir)


def largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max((first[key] - second[key]).abs().max().item() for key in first)


def local_checksum(unet) -> float:
    return float(sum(parameter.to_local().double().sum().item() * (index + 1) for index, parameter in enumerate(unet.parameters())))


def main(pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    pipeline, output = Path(pipeline_dir), Path(output_dir)
    meshes = {"full": device_mesh(world.device.type, world.world_size), "hsdp": device_mesh(world.device.type, world.world_size, GROUPS)}
    report: dict = {}
    for name in OPTIMIZER_NAMES:
        unet, _, step = fresh(pipeline, meshes["full"], name)
        for update in range(2):
            step(rank_batch(unet, world, update), epoch=0)
        full = full_weights(unet)
        full_local_bytes = local_parameter_bytes(unet)

        checkpoint = output / f"hsdp_{name}"
        unet, optimizer, step = fresh(pipeline, meshes["hsdp"], name)
        step(rank_batch(unet, world, 0), epoch=0)
        if name == RESUMED_OPTIMIZER:
            save_training_state_by_writer_process(checkpoint, unet, optimizer, None, *saved_state_of(step, name, world.world_size))
        step(rank_batch(unet, world, 1), epoch=0)
        hsdp = full_weights(unet)
        if "clipping" not in report:  # on the HSDP UNet as it is; replicas hold the same gradients
            # Clipped only: torch's reference on DTensors of a 2-D mesh is a seventh of this worker's time, and
            # an unclipped norm (max_norm inf) is checked on one mesh dimension in train_step_worker.py.
            report["clipping"] = clipping_against_torch(unet, seed=world.rank % (world.world_size // GROUPS), max_norms=(1.0,))
        result = {
            "hsdp_vs_full": largest_difference(hsdp, full),
            "local_bytes": {"full": full_local_bytes, "hsdp": local_parameter_bytes(unet)},
            "local_checksum": local_checksum(unet),
            "placements": [str(placement) for placement in next(unet.parameters()).placements],
        }
        if name == RESUMED_OPTIMIZER:
            for layout in ("hsdp", "full"):
                unet, optimizer, step = fresh(pipeline, meshes[layout], name)
                load_training_state(checkpoint, unet, optimizer, None)
                step(rank_batch(unet, world, 1), epoch=0)
                result[f"resumed_as_{layout}_vs_hsdp"] = largest_difference(full_weights(unet), hsdp)
        report[name] = result
    (output / f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
