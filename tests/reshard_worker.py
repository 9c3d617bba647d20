"""Run under torchrun by test_checkpoint.py. Mode `save` (2 processes): one update per optimizer, then a
checkpoint, the full weights and full optimizer state written to reference files. Mode `load` (any number
of processes): restore each checkpoint into a fresh sharded UNet and optimizer, and write the largest
difference from the reference, plus the loss of one more update (must be finite), to rank0.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from sdxl_trainer.checkpoint import load_training_state, save_training_state
from sdxl_trainer.ema import ShardedEMA
from sdxl_trainer.optimizers import OPTIMIZERS, build_optimizer
from sdxl_trainer.parallel import init_distributed, shutdown_distributed
from train_step_worker import LEARNING_RATES, full_weights, rank_batch, sharded_unet
from unet_batches import make_train_step


def full_optimizer_state(unet, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, whole and dequantised, keyed by parameter name."""
    names = {parameter: name for name, parameter in unet.named_parameters()}
    full = {}
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                full[f"{names[parameter]}/{key}"] = whole.float().clone() if type(whole) is torch.Tensor else whole.dequantize().float()
    return full


def fresh(name: str, pipeline_dir: Path, world):
    unet = sharded_unet(pipeline_dir, world)
    optimizer = build_optimizer(name, unet.parameters(), LEARNING_RATES[name], 1e-2, (0.9, 0.99), 1e-8)
    ema = ShardedEMA(unet, decay=0.9, on_cpu=False)
    return unet, optimizer, ema, make_train_step(unet, optimizer, pipeline_dir, ema=ema)


def main(mode: str, pipeline_dir: str, output_dir: str) -> None:
    world = init_distributed()
    pipeline, output = Path(pipeline_dir), Path(output_dir)
    report = {}
    for name in OPTIMIZERS:
        unet, optimizer, ema, step = fresh(name, pipeline, world)
        if mode == "save":
            step(rank_batch(unet, world, 0), epoch=0)
            save_training_state(output / name, unet, optimizer, ema, {"optimizer": name})
            reference = {**full_weights(unet), **{f"ema/{key}": value for key, value in ema.full_state_dict_on_rank0(True).items()}}
            reference.update(full_optimizer_state(unet, optimizer))
            if world.is_main:
                save_file({key: value.contiguous() for key, value in reference.items()}, output / f"{name}_reference.safetensors")
            continue
        load_training_state(output / name, unet, optimizer, ema)
        restored = {**full_weights(unet), **{f"ema/{key}": value for key, value in ema.full_state_dict_on_rank0(True).items()}}
        restored.update(full_optimizer_state(unet, optimizer))
        reference = load_file(output / f"{name}_reference.safetensors")
        report[name] = {
            "missing": sorted(set(reference) - set(restored)),
            "max_difference": max((reference[key] - restored[key]).abs().max().item() for key in reference if key in restored),
            "next_loss": step([batch for batch in rank_batch(unet, world, 1)], epoch=0).loss,
        }
    if mode == "load" and world.is_main:
        (output / f"load_on_{world.world_size}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
