"""Run under torchrun by test_checkpoint.py, with a mode and a comma-separated list of optimizers:
- `save` (any number of processes): one update per optimizer, then a checkpoint `<optimizer>/`, and the full weights,
  EMA and optimizer state written to `<optimizer>_reference.safetensors`;
- `load` (any number of processes): restore each checkpoint into a fresh UNet (sharded, or plain on one
  process, as the trainer prepares it), optimizer and EMA;
  write the largest difference from the reference and the loss of one more update to load_on_<N>.json;
- `die_during_save`: like `save`, then a second checkpoint `<optimizer>_update_2` during which rank 1 is
  killed (SIGKILL) after writing its shards;
- `handoff`: hand the trained UNet to every rank through PipelineHandoff and write, per rank, the largest
  difference between the loaded and the trained weights, and whether the folder is gone afterwards."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from train_step_worker import LEARNING_RATES, full_weights, rank_batch
from unet_batches import make_train_step, save_training_state, saved_state_of

from sdxl_trainer.distributed.fsdp import full_state_dict_on_rank0, prepare_unet
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.evaluation.handoff import PipelineHandoff
from sdxl_trainer.optimizers.build import build_optimizer
from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.training.ema import ShardedEMA


def whole(value: torch.Tensor) -> torch.Tensor:
    """A state tensor gathered onto every rank, dequantised, as fp32.

    An 8-bit moment is dequantised on each rank (its blocks never span ranks) and the fp32 values are
    gathered: DTensor's full_tensor() of torchao's 8-bit subclass hands back codes and scales whose
    collectives were never waited for (torch 2.14, torchao 0.18), and runs that used it died now and then
    of a corrupted heap (3 of 68 launches of `save`)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    local = local.float() if type(local) is torch.Tensor else local.dequantize().float()
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()).full_tensor()


def full_optimizer_state(unet, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, whole and dequantised, keyed by parameter name."""
    names = {parameter: name for name, parameter in unet.named_parameters()}
    return {
        f"{names[parameter]}/{key}": whole(value).clone()
        for parameter, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.ndim > 0
    }


def fresh(name: str, pipeline_dir: Path, world):
    unet = prepare_unet(UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet"), world, param_dtype=None)
    optimizer = build_optimizer(name, unet.parameters(), LEARNING_RATES[name], 1e-2, (0.9, None), 1e-8)
    ema = ShardedEMA(unet, decay=0.9, on_cpu=False)
    return unet, optimizer, ema, make_train_step(unet, optimizer, pipeline_dir, ema=ema)


class DyingWriter(JsonIndexWriter):
    """Kills rank 1 after its shards are written, before the checkpoint is finished."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if self.rank == 1 or os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return written


def handoff_report(pipeline_dir: Path, output: Path, world) -> dict:
    unet, optimizer, ema, step = fresh("adamw", pipeline_dir, world)
    step(rank_batch(unet, world, 0), epoch=0)
    trained = full_weights(unet)
    with PipelineHandoff(output, "test_run", str(pipeline_dir), str(pipeline_dir), world.device, torch.float32) as handoff:
        pipeline = handoff.pipeline({"unet": full_state_dict_on_rank0(unet)})
        folder = handoff.folder
        loaded = dict(pipeline.unet.named_parameters())
        difference = max((trained[name] - loaded[name].detach()).abs().max().item() for name in trained)
    base = load_file(pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    report = {
        "max_difference": difference,
        "trained_vs_base": max((trained[name] - base[name]).abs().max().item() for name in trained),
        "folder_removed": not folder.exists(),
        "folder": str(folder),
    }
    try:
        with PipelineHandoff(output, "failing_run", str(pipeline_dir), str(pipeline_dir), world.device, torch.float32) as handoff:
            handoff.pipeline({"unet": full_state_dict_on_rank0(unet)})
            failing_folder = handoff.folder
            raise RuntimeError("validation failed")
    except RuntimeError:
        report["removed_after_error"] = not failing_folder.exists()
    return report


def main(mode: str, pipeline_dir: str, output_dir: str, optimizers: str) -> None:
    world = init_distributed()
    pipeline, output = Path(pipeline_dir), Path(output_dir)
    if mode == "handoff":
        (output / f"handoff_rank{world.rank}.json").write_text(json.dumps(handoff_report(pipeline, output, world)))
        shutdown_distributed()
        return
    report = {}
    for name in optimizers.split(","):
        unet, optimizer, ema, step = fresh(name, pipeline, world)
        if mode in ("save", "die_during_save"):
            step(rank_batch(unet, world, 0), epoch=0)
            save_training_state(output / name, unet, optimizer, ema, *saved_state_of(step, name, world.world_size))
            reference = {**full_weights(unet), **{f"ema/{key}": value for key, value in ema.full_state_dict_on_rank0(True).items()}}
            reference.update(full_optimizer_state(unet, optimizer))
            if world.is_main:
                save_file({key: value.contiguous() for key, value in reference.items()}, output / f"{name}_reference.safetensors")
            if mode == "die_during_save":
                step(rank_batch(unet, world, 1), epoch=0)
                save_training_state(output / f"{name}_update_2", unet, optimizer, ema, *saved_state_of(step, name, world.world_size), writer_factory=DyingWriter)
            continue
        load_training_state(output / name, unet, optimizer, ema)
        restored = {**full_weights(unet), **{f"ema/{key}": value for key, value in ema.full_state_dict_on_rank0(True).items()}}
        restored.update(full_optimizer_state(unet, optimizer))
        reference = load_file(output / f"{name}_reference.safetensors")
        weight_keys = [key for key in reference if "/" not in key]
        report[name] = {
            "missing": sorted(set(reference) - set(restored)),
            "weights_max_difference": max((reference[key] - restored[key]).abs().max().item() for key in weight_keys),
            "state_max_difference": max((reference[key] - restored[key]).abs().max().item() for key in reference if key in restored),
            "next_loss": step(rank_batch(unet, world, 1), epoch=0).loss,
        }
    if mode == "load" and world.is_main:
        (output / f"load_on_{world.world_size}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
