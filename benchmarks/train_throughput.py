"""The trainer's update next to a plain PyTorch loop on the same model, batch and optimizer: images/s per
GPU, step time, the optimizer step's own time, MFU and peak memory of each, and their ratio. The full-size
SDXL UNet (random weights, no download) on GPUs; the tiny one on the CPU.

    # one configuration on 1 GPU (or the CPU)
    venv/bin/python benchmarks/train_throughput.py --batch_size 4 [--no-gradient_checkpointing] [--compile]
    # batch 1, 4, 8 x gradient checkpointing on/off in one table, written for benchmarks/results/
    venv/bin/python benchmarks/train_throughput.py --sweep --output benchmarks/results/DATE-GPU-1proc.md
    # sharded over 2 GPUs: what each GPU needs when the model states are split in two
    torchrun --nproc_per_node 2 benchmarks/train_throughput.py --sweep --output benchmarks/results/DATE-GPU-2proc.md
    # where the time of one configuration goes: operator tables and busy/wall figures (torch.profiler)
    venv/bin/python benchmarks/train_throughput.py --batch_size 4 --profile benchmarks/results/DATE-GPU-profile
    # the trainer's whole update (data loading and logging) against the plain loop on a shared CPU, 1 and 2 processes
    venv/bin/python benchmarks/train_throughput.py --model tiny --resolution 256 --batch_size 2 --data_loading --rounds 3 \\
        --warmup_steps 2 --measured_steps 6
    venv/bin/torchrun --nproc_per_node 2 benchmarks/train_throughput.py --model tiny ...   (the same flags)
    # the CPU smoke test (tests/benchmarks/test_train_throughput.py)
    venv/bin/python benchmarks/train_throughput.py --model tiny --resolution 64 --warmup_steps 1 --measured_steps 2

The two paths (benchmarks/lib/steps.py): the trainer = TrainStep over the UNet as prepare_unet leaves it, with
build_optimizer's optimizer, as sdxl_FSDP_train.py runs each update (with --data_loading also reading and
logging it as the trainer does); the reference = the same model, batch and optimizer in a minimal loop:
"plain" (1 process) over a plain nn.Module under torch.autocast, so the ratio prices everything the trainer's
step adds; "fsdp2" (several processes) by hand over the same FSDP2 sharding, so the ratio prices TrainStep
alone. How they are run and timed: benchmarks/lib/comparison.py (one after the other, or --rounds
alternating); FLOP per image and MFU: benchmarks/lib/flops.py; the method: docs/design.md §8.
Optimizer ms: optimizer.step alone, the device synchronized around it, over a few steps after the measured
windows. Peak memory: torch.cuda's allocated and reserved peaks of each path, the largest over ranks; on the
CPU the table reads n/a and the process's peak resident size is printed below it. Under torchrun a row that
runs out of memory reads OOM only if every rank runs out (they hold equal shards and run the same shapes);
otherwise the run stops at the collective's timeout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402

from benchmarks.lib.comparison import (  # noqa: E402
    ATTENTION_BACKENDS, GPU_ONLY_ATTENTION, Measurement, PathResult, compare, resolve_reference, summary, table, use_trainer_matmul_precision,
)
from benchmarks.lib.flops import matmul_peak_flops  # noqa: E402
from benchmarks.lib.profiling import PROFILED_STEPS  # noqa: E402
from benchmarks.lib.results import write_json, write_markdown  # noqa: E402
from benchmarks.lib.steps import OPTIMIZER_CHOICES, TORCHAO_ADAMW8BIT, StepSettings  # noqa: E402
from benchmarks.lib.unets import MODEL_HELP, UNET_BUILDERS, resolution_multiple  # noqa: E402
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed  # noqa: E402
from sdxl_trainer.jobs.train_config import DTYPE_OF_NAME, resolve_compute_dtype  # noqa: E402
from sdxl_trainer.monitoring.memory_peaks import peak_memory_gib  # noqa: E402

SWEEP_BATCH_SIZES = (1, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(UNET_BUILDERS), default="sdxl", help=MODEL_HELP)
    parser.add_argument("--resolution", type=int, default=1024, help="square image side in px; latents are resolution/8 per side, 4 channels")
    parser.add_argument("--batch_size", type=int, default=1, help="images per process per step (--sweep runs 1, 4 and 8 instead)")
    parser.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute activations in backward, in both paths (--sweep runs both settings instead)")
    parser.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw8bit",
                        help=f"build_optimizer's optimizer, in both paths; {TORCHAO_ADAMW8BIT} = torchao's own AdamW8bit, which steps "
                        "tensor by tensor (the trainer's adamw8bit keeps its state and steps many tensors per kernel), to compare with")
    parser.add_argument("--mixed_precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                        help="compute dtype, as the trainer's option: auto = bf16 on GPUs that support it, else fp16; fp32 on the CPU")
    parser.add_argument("--weights_dtype", choices=tuple(DTYPE_OF_NAME), default="fp32",
                        help="the trainer's --weights_dtype: fp32 master weights, or bf16 weights and gradients with stochastic "
                        "rounding in the optimizer (compute is then bf16)")
    parser.add_argument("--cpu_offload", action="store_true",
                        help="the trainer's --cpu_offload: weights, gradients and optimizer state in host memory, the step on the CPU "
                        "(trainer path only: --reference none)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="regional torch.compile of each transformer and ResNet block (compile_repeated_blocks), in both paths")
    parser.add_argument("--recompile_limit", type=int, default=None,
                        help="with --compile: Dynamo's graphs per compiled forward, set after compile_repeated_blocks raised it "
                        "(8 = Dynamo's default: SDXL's last 4 ResNet shapes then run eagerly), to measure what the raise buys")
    parser.add_argument("--attention", choices=tuple(ATTENTION_BACKENDS), default="sdpa",
                        help="sdpa = PyTorch picks the kernel; flash, efficient, cudnn or math restrict SDPA to that kernel "
                        "(efficient and cudnn need a GPU)")
    parser.add_argument("--warmup_steps", type=int, default=3, help="untimed steps before the measured window (compiles, allocator)")
    parser.add_argument("--measured_steps", type=int, default=10, help="steps in the timed window (in each round with --rounds)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="1 = each path built, timed and freed in turn (a GPU holds one full-size path at a time); N > 1 = both "
                        "paths built at once and their measured windows alternating N times, so that a shared machine's noise hits "
                        "them alike (the CPU); peak memory then reads n/a")
    parser.add_argument("--data_loading", action="store_true",
                        help="the trainer path also reads each update as the trainer does (its data stream and DataLoader workers over "
                        "a synthetic cache written first) and logs it (every rank's peak memory, TensorBoard); the reference keeps "
                        "its batch on the device. Prints the share of the update spent waiting for data")
    parser.add_argument("--reference", choices=("auto", "plain", "fsdp2", "none"), default="auto",
                        help="minimal loop to compare with: plain = nn.Module under autocast (1 process only); fsdp2 = "
                        "hand-written loop over the same FSDP2 model; auto = plain on 1 process, fsdp2 on several; none = skip")
    parser.add_argument("--sweep", action="store_true",
                        help="batch 1, 4, 8 x gradient checkpointing on/off in one table (with --optimizer, adamw8bit by default); "
                        "a path that runs out of GPU memory reads OOM")
    parser.add_argument("--output", type=Path, help="also write the table, with the date, device, driver, library versions, git commit "
                        "and this command, to this Markdown file (for benchmarks/results/)")
    parser.add_argument("--json", type=Path, help="also write every row's figures and the run's settings to this JSON file")
    parser.add_argument("--profile", type=Path,
                        help=f"also profile {PROFILED_STEPS} more steps of each path with torch.profiler and write, into this folder, "
                        "each path's busiest operators (PATH_batchB_ckptX.txt) and where its time went (profiles.json): device busy "
                        "against wall time, and the optimizer step's share")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int, device: torch.device, compute_dtype: torch.dtype) -> list[str]:
    problems = []
    multiple = resolution_multiple(args.model)
    if args.resolution < multiple or args.resolution % multiple:
        problems.append(f"--resolution {args.resolution} must be a positive multiple of {multiple} for --model {args.model}")
    for name, least in (("batch_size", 1), ("warmup_steps", 0), ("measured_steps", 1), ("rounds", 1)):
        if getattr(args, name) < least:
            problems.append(f"--{name} must be at least {least}")
    if args.attention in GPU_ONLY_ATTENTION and device.type != "cuda":
        problems.append(f"--attention {args.attention} has no CPU kernel: use sdpa, flash or math without a GPU")
    if args.attention == "flash" and device.type == "cuda" and compute_dtype == torch.float32:
        problems.append("--attention flash needs bf16 or fp16 on a GPU: use --mixed_precision bf16, or --attention efficient for fp32")
    if args.sweep and (args.batch_size != 1 or not args.gradient_checkpointing):
        problems.append("--sweep runs batch 1, 4 and 8 with checkpointing on and off: drop --batch_size and --no-gradient_checkpointing")
    if args.cpu_offload and args.reference not in ("none", "auto"):
        problems.append("--cpu_offload measures the trainer path alone: drop --reference (or pass --reference none)")
    if args.weights_dtype == "bf16" and args.mixed_precision not in ("auto", "bf16"):
        problems.append("--weights_dtype bf16 computes in bf16: use --mixed_precision bf16 (or auto on a GPU with bf16)")
    if args.reference == "plain" and world_size > 1:
        problems.append("--reference plain runs an unsharded model and compares only on 1 process: use --reference fsdp2 (or auto) under torchrun")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = init_distributed()
    compute_dtype = resolve_compute_dtype(args.mixed_precision, world.device, args.weights_dtype)
    problems = check_args(args, world.world_size, world.device, compute_dtype)
    if problems:
        raise SystemExit("Cannot run the benchmark:\n  " + "\n  ".join(problems))
    settings = StepSettings(args.model, args.resolution, args.batch_size, args.gradient_checkpointing, args.optimizer, args.weights_dtype, compute_dtype,
                            args.compile, args.recompile_limit, args.cpu_offload)  # fmt: skip
    reference = resolve_reference(args.reference, settings, world.world_size)
    use_trainer_matmul_precision(world.device)
    peak_flops = matmul_peak_flops(world.device, compute_dtype)
    rows = [settings]
    if args.sweep:
        rows = [settings.with_row(batch_size, checkpointing) for checkpointing in (True, False) for batch_size in SWEEP_BATCH_SIZES]
    measurement = Measurement(args.warmup_steps, args.measured_steps, args.rounds, args.attention, args.data_loading, args.profile)
    results = compare(rows, reference, measurement, world)
    if world.is_main:
        report = "\n\n".join([summary(rows, reference, measurement, peak_flops, world), table(results, peak_flops), host_lines(results)])
        if world.device.type != "cuda":
            peak = peak_memory_gib(world.device)
            report += f"\nCPU: no per-path memory figure; this process's peak resident size over the whole run was {peak:.2f} GiB."
        print(report)
        if args.output:
            title = f"Training throughput: {args.model} UNet, {args.resolution} px, {world.world_size} process(es)"
            write_markdown(args.output, title, report, world.device)
        if args.json:
            figures = {
                "processes": world.world_size, "compute_dtype": str(compute_dtype).removeprefix("torch."), "peak_flops": peak_flops,
                "settings": vars(args),  # paths written as text
                "rows": [result.figures(peak_flops) for result in results],
            }  # fmt: skip
            write_json(args.json, figures, world.device)
    shutdown_distributed()
    return 0


def host_lines(results: list[PathResult]) -> str:
    """Per path, what the host spent on each measured step (rank of most): CPU time, minor page faults, and with
    --data_loading the trainer's wait for its data."""
    lines = []
    for result in results:
        if result.seconds_per_step is None:
            continue
        data = "" if result.data_wait_share is None else f", waiting for data {result.data_wait_share:.2%} of the update"
        lines.append(f"- host, batch {result.settings.batch_size}, {result.path}: CPU {result.cpu_seconds_per_step * 1000:.1f} ms per step "
                     f"(all threads), {result.minor_faults_per_step:.0f} minor page faults per step{data}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
