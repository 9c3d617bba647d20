"""Run under torchrun by test_distributed.py: shard the tiny UNet with the trainer's own shard_unet and
write, per rank, how many parameter bytes the rank stores next to the full model's size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

from sdxl_trainer.distributed.fsdp import local_parameter_bytes, shard_unet
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed


def main(pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    full_bytes = local_parameter_bytes(unet)
    shard_unet(unet, world.mesh, param_dtype=None)
    placements = {str(parameter.placements) for parameter in unet.parameters()}
    report = {
        "rank": world.rank,
        "world_size": world.world_size,
        "full_bytes": full_bytes,
        "local_bytes": local_parameter_bytes(unet),
        "placements": sorted(placements),
        "all_dtensor": all(hasattr(parameter, "to_local") for parameter in unet.parameters()),
    }
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
