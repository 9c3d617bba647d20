"""How far bf16 and fp16 training drift from fp32 on the full-size SDXL UNet over a few updates, on a GPU.

    venv/bin/python benchmarks/gpu_numerics.py --output benchmarks/results/DATE-GPU-numerics.json
    # the CPU smoke test: the tiny UNet (tests/benchmarks/test_gpu_numerics.py)
    venv/bin/python benchmarks/gpu_numerics.py --model tiny --resolution 64 --updates 2

Each precision trains the same random UNet (seeded) on the same synthetic batch with TrainStep, as
train_throughput.py's trainer path (benchmarks/lib/steps.py) does (per-sample seeded noise and timesteps, so every run draws the same):
- fp32: fp32 weights and compute, TF32 off: the reference;
- bf16: fp32 master weights, compute under bf16 (the trainer's default on GPUs);
- fp16: the same in fp16, with the sharded gradient scaler;
- bf16 weights: --weights_dtype bf16, bf16 weights and gradients with stochastic rounding;
- bf16 reduce (on several processes only: one is not sharded): bf16 compute with --reduce_dtype bf16, the
  gradients reduce-scattered in bf16 (half the bytes, for PCIe links) where bf16 reduces them in fp32.
Printed per precision: each update's loss, its largest relative difference from fp32's, and the relative
error of the whole weight change after the last update, |dW - dW_fp32| / |dW_fp32| over all parameters
(0 = the same update as fp32; 1 = as far from it as the update is large).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.lib.results import device_name, write_json  # noqa: E402
from benchmarks.lib.steps import OPTIMIZER_CHOICES, StepSettings, build_trainer  # noqa: E402 - the trainer path train_throughput.py times
from benchmarks.lib.unets import MODEL_HELP, UNET_BUILDERS  # noqa: E402
from sdxl_trainer.distributed.local_shard import local_shard  # noqa: E402
from sdxl_trainer.distributed.world import World, init_distributed, shutdown_distributed  # noqa: E402

PRECISIONS = {  # name -> (compute dtype, weights dtype, gradient reduction dtype)
    "fp32": (torch.float32, "fp32", torch.float32),
    "bf16": (torch.bfloat16, "fp32", torch.float32),
    "fp16": (torch.float16, "fp32", torch.float32),
    "bf16 weights": (torch.bfloat16, "bf16", torch.float32),
    "bf16 reduce": (torch.bfloat16, "fp32", torch.bfloat16),
}


def train(args: argparse.Namespace, precision: str, world: World) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of each update, and each parameter's change over all of them (fp32, on the device)."""
    compute_dtype, weights_dtype, reduce_dtype = PRECISIONS[precision]
    settings = StepSettings(model=args.model, resolution=args.resolution, batch_size=args.batch_size, gradient_checkpointing=True,
                            optimizer=args.optimizer, weights_dtype=weights_dtype, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)  # fmt: skip
    path = build_trainer(settings, world)
    before = [parameter.detach().float().clone() for parameter in path.model.parameters()]
    losses = [path.step(index).loss for index in range(args.updates)]
    changes = [parameter.detach().float() - start for parameter, start in zip(path.model.parameters(), before)]
    return losses, changes


def relative_error(changes: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """|changes - reference| / |reference| over every parameter, on all ranks (each sums its own shards)."""
    sums = torch.zeros(2, dtype=torch.float64, device=reference[0].device)
    for change, expected in zip(changes, reference):
        change, expected = local_shard(change).double(), local_shard(expected).double()
        sums += torch.stack([(change - expected).square().sum(), expected.square().sum()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    difference, size = sums.tolist()
    return math.sqrt(difference / size) if size else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(UNET_BUILDERS), default="sdxl", help=MODEL_HELP)
    parser.add_argument("--resolution", type=int, default=512, help="square image side in px")
    parser.add_argument("--batch_size", type=int, default=2, help="images per update")
    parser.add_argument("--updates", type=int, default=4, help="updates each precision trains")
    parser.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw8bit", help="build_optimizer's name (the trainer's default: adamw8bit)")
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    world = init_distributed()
    on_gpu = world.device.type == "cuda"
    if on_gpu:  # the reference is true fp32: no TF32 in matmuls and convolutions
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    precisions = [
        name for name in PRECISIONS
        if (on_gpu or PRECISIONS[name][0] != torch.float16)  # fp16 matmuls: GPU only
        and (world.world_size > 1 or PRECISIONS[name][2] == torch.float32)  # one process reduces nothing
    ]  # fmt: skip
    reference_losses, reference_changes = train(args, "fp32", world)
    rows = [{"precision": "fp32", "losses": reference_losses, "max_loss_difference": 0.0, "weight_change_error": 0.0}]
    bf16_changes = None
    for precision in precisions[1:]:
        losses, changes = train(args, precision, world)
        loss_difference = max(abs(loss - expected) / abs(expected) for loss, expected in zip(losses, reference_losses))
        rows.append({"precision": precision, "losses": losses, "max_loss_difference": loss_difference,
                     "weight_change_error": relative_error(changes, reference_changes)})  # fmt: skip
        if precision == "bf16" and "bf16 reduce" in precisions:
            bf16_changes = changes  # what the bf16 reduction alone changes: its update against bf16's
        elif precision == "bf16 reduce":
            rows[-1]["weight_change_error_vs_bf16"] = relative_error(changes, bf16_changes)
        del changes
        if on_gpu:
            torch.cuda.empty_cache()
    if not world.is_main:
        shutdown_distributed()
        return 0
    print(f"{args.model} UNet, {args.resolution} px, batch {args.batch_size}, {args.updates} updates of {args.optimizer} "
          f"on {world.world_size} x {device_name(world.device)}:")  # fmt: skip
    for row in rows:
        losses = " ".join(f"{loss:.5f}" for loss in row["losses"])
        against_bf16 = f" ({row['weight_change_error_vs_bf16']:.2e} against bf16's)" if "weight_change_error_vs_bf16" in row else ""
        print(f"  {row['precision']:<13} losses {losses}; largest loss difference {row['max_loss_difference']:.2%}, "
              f"weight change error {row['weight_change_error']:.3f}{against_bf16}")  # fmt: skip
    if args.output:
        write_json(args.output, {"settings": vars(args) | {"output": str(args.output)}, "rows": rows}, world.device)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
