"""Training throughput, model FLOP utilisation and peak memory of our real training step on the full-size
SDXL UNet (random weights, no download), next to a minimal reference loop run in the same process.

    # one configuration on 1 GPU (or the CPU)
    venv/bin/python benchmarks/train_throughput.py --batch_size 4 [--no-gradient_checkpointing] [--compile]
    # batch 1, 4, 8 x gradient checkpointing on/off in one table, written for benchmarks/results/
    venv/bin/python benchmarks/train_throughput.py --sweep --output benchmarks/results/DATE-GPU-1proc.md
    # sharded over 2 GPUs: what each GPU needs when the model states are split in two
    torchrun --nproc_per_node 2 benchmarks/train_throughput.py --sweep --output benchmarks/results/DATE-GPU-2proc.md
    # where the time of one configuration goes: operator tables and busy/wall figures (torch.profiler)
    venv/bin/python benchmarks/train_throughput.py --batch_size 4 --profile benchmarks/results/DATE-GPU-profile
    # the CPU smoke test (tests/benchmarks/test_train_throughput.py)
    venv/bin/python benchmarks/train_throughput.py --model tiny --resolution 64 --warmup_steps 1 --measured_steps 2

Both paths train on one synthetic batch kept on the device: latents of resolution/8 per side, caption
embeddings of 77 tokens, pooled embeddings and 6 time ids, their widths taken from the UNet's config.
- trainer: sdxl_trainer's TrainStep over the UNet as prepare_unet leaves it, as in sdxl_FSDP_train.py
  (several processes: FSDP2, compute in bf16 over fp32 master shards, fp32 gradient reduction; one process:
  a plain module under torch.autocast over fp32 weights) with build_optimizer's optimizer: per-sample seeded noise,
  timesteps and caption dropout, the loss all-reduce, clipping, the NaN/inf check, the optimizer and LR
  steps. That is what sdxl_FSDP_train.py runs per update, less data loading and logging (bench_trainer.py
  measures those).
- reference "plain" (the default on 1 process): the same architecture and weights as a plain nn.Module,
  fp32 weights under torch.autocast, noise and timesteps from the device's RNG, MSE, backward, clipping and
  the same optimizer. Chosen because it is what a minimal single-GPU PyTorch loop looks like, so the ratio
  prices everything our step adds: the seeded per-sample randomness and the host syncs of the NaN/inf check.
- reference "fsdp2" (the default on several processes, where a plain module would not be sharded and
  could not be compared): the same forward/backward/clip/step written by hand over the same shard_unet
  model, as bench_trainer.py does; the ratio then prices TrainStep alone.
The paths run one after the other, each with its own warm-up, and each model is freed before the next is
built: two full-size UNets with fp32 weights, gradients and 8-bit AdamW states hold about 51 GB before any
activation, and a dedicated GPU's step time is steady after warm-up. (bench_trainer.py alternates rounds
instead, as a shared 2-core CPU is not steady; CPU figures here are a smoke test, not a measurement.)

FLOP per image: FlopCounterMode over one forward + backward at batch 1 of the same configuration, run on
the meta device (shapes only: no compute and no memory, so it is the same on any machine), with attention
through SDPA's math backend so that its matmuls count on every device. With gradient checkpointing the
recomputed forward counts too, so that MFU is then strictly hardware FLOP utilisation. diffusers recomputes
the ResNet and transformer blocks, not the whole forward: SDXL at 1024 px counts 20.23 TFLOP per image
without checkpointing and 25.44 with it (issue 7's nominal figures, 20.3 and 27.0, assume a full recompute). Peak: a large matmul in the compute dtype, timed here on this device (bf16 8192^3 on a GPU).
MFU = images/s per GPU x FLOP per image / peak.
Optimizer ms: optimizer.step alone, the device synchronized before and after it (global step hooks), over
OPTIMIZER_TIMED_STEPS steps after the measured window so the synchronizations stay out of its timing.
Run once with --optimizer torchao_adamw8bit to see what the trainer's multi-tensor 8-bit step saves over
torchao's per-tensor one (about 1,700 compiled calls for SDXL on every rank).
Peak memory: torch.cuda.max_memory_allocated / max_memory_reserved of each path (reset before its model is
built; the largest over ranks). On the CPU there is no per-path figure: the table reads n/a, and the
process's peak resident size over the whole run is printed below it.
Under torchrun a row that runs out of memory reads OOM only if every rank runs out (they hold equal
shards and run the same shapes, so they normally do); otherwise the run stops at the collective's timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests" / "support")]  # tests/support/ for the synthetic batches the unit tests use

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import DDPMScheduler, UNet2DConditionModel  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torchao.optim import AdamW8bit as TorchaoAdamW8bit  # noqa: E402
from unet_batches import empty_prompt_for, synthetic_batch  # noqa: E402

from sdxl_trainer.distributed.fsdp import compile_repeated_blocks, prepare_unet, shard_unet
from sdxl_trainer.distributed.world import World, init_distributed, shutdown_distributed  # noqa: E402
from sdxl_trainer.jobs.train_config import DTYPE_OF_NAME, resolve_compute_dtype  # noqa: E402
from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, SDXL_UNET_CONFIG, build_full_size_unet  # noqa: E402
from sdxl_trainer.models.tiny import TINY_UNET_CONFIG
from sdxl_trainer.monitoring.memory_peaks import gather_floats, peak_memory_gib
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer  # noqa: E402
from sdxl_trainer.training.lr_schedule import LearningRateSchedule  # noqa: E402
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.step import TrainStep  # noqa: E402

SEED = 0
UNET_BUILDERS = {"sdxl": build_full_size_unet, "tiny": lambda: UNet2DConditionModel(**TINY_UNET_CONFIG)}
UNET_CONFIGS = {"sdxl": SDXL_UNET_CONFIG, "tiny": TINY_UNET_CONFIG}
# Issue 7's figures for SDXL at 1024 px: TFLOP per training image without / with activation recompute.
NOMINAL_TFLOP_1024 = {False: 20.3, True: 27.0}
SWEEP_BATCH_SIZES = (1, 4, 8)
ATTENTION_BACKENDS = {
    "sdpa": None,  # PyTorch picks the kernel
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
GPU_ONLY_ATTENTION = ("efficient", "cudnn")
COLUMNS = (
    "batch", "checkpointing", "path", "images/s per GPU", "ms per step", "optimizer ms", "MFU %", "peak allocated GiB",
    "peak reserved GiB", "step time / reference",
)
TORCHAO_ADAMW8BIT = "torchao_adamw8bit"
OPTIMIZER_TIMED_STEPS = 3  # after the measured window: the synchronizations around optimizer.step stay out of it
PROFILED_STEPS = 2  # after those: the profiler's own overhead stays out of every other figure


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(UNET_BUILDERS), default="sdxl",
                        help="sdxl = the full-size SDXL UNet from its published config (2.57 B parameters, random weights); "
                        "tiny = the tests' tiny SDXL UNet, for the CPU smoke test")
    parser.add_argument("--resolution", type=int, default=1024, help="square image side in px; latents are resolution/8 per side, 4 channels")
    parser.add_argument("--batch_size", type=int, default=1, help="images per process per step (--sweep runs 1, 4 and 8 instead)")
    parser.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute activations in backward, in both paths (--sweep runs both settings instead)")
    parser.add_argument("--optimizer", choices=(*OPTIMIZERS, TORCHAO_ADAMW8BIT), default="adamw8bit",
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
    parser.add_argument("--measured_steps", type=int, default=10, help="steps in the timed window")
    parser.add_argument("--reference", choices=("auto", "plain", "fsdp2", "none"), default="auto",
                        help="minimal loop to compare with: plain = nn.Module under autocast (1 process only); fsdp2 = "
                        "hand-written loop over the same FSDP2 model; auto = plain on 1 process, fsdp2 on several; none = skip")
    parser.add_argument("--sweep", action="store_true",
                        help="batch 1, 4, 8 x gradient checkpointing on/off in one table (with --optimizer, adamw8bit by default); "
                        "a path that runs out of GPU memory reads OOM")
    parser.add_argument("--output", type=Path, help="also write the table, with the date, device, driver, library versions "
                        "and this command, to this Markdown file (for benchmarks/results/)")
    parser.add_argument("--json", type=Path, help="also write every row's figures and the run's settings to this JSON file")
    parser.add_argument("--profile", type=Path,
                        help=f"also profile {PROFILED_STEPS} more steps of each path with torch.profiler and write, into this folder, "
                        "each path's busiest operators (PATH_batchB_ckptX.txt) and where its time went (profiles.json): device busy "
                        "against wall time, and the optimizer step's share")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int, device: torch.device, compute_dtype: torch.dtype) -> list[str]:
    problems = []
    levels = len(UNET_CONFIGS[args.model]["block_out_channels"])
    multiple = 8 * 2 ** (levels - 1)  # the VAE's 8x, then the UNet halves the latents levels - 1 times
    if args.resolution < multiple or args.resolution % multiple:
        problems.append(f"--resolution {args.resolution} must be a positive multiple of {multiple} for --model {args.model}")
    for name, least in (("batch_size", 1), ("warmup_steps", 0), ("measured_steps", 1)):
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


@dataclass(frozen=True)
class Row:
    batch_size: int
    gradient_checkpointing: bool


@dataclass
class PathResult:
    row: Row
    path: str
    seconds_per_step: float | None  # None: ran out of GPU memory
    first_step_seconds: float | None  # the first warm-up step alone: compilation and the allocator's first requests
    optimizer_seconds: float | None  # of optimizer.step alone; None: out of memory, or every step skipped (fp16 overflow)
    peak_allocated_gib: float | None  # None: not measured (CPU)
    peak_reserved_gib: float | None


def new_unet(args: argparse.Namespace, row: Row, device: torch.device | str) -> UNet2DConditionModel:
    """The model in training mode, built directly on `device` with the same random weights every time."""
    torch.manual_seed(SEED)
    with torch.device(device):
        unet = UNET_BUILDERS[args.model]()
    if args.weights_dtype != "fp32":  # cast, as the trainer loads fp32 weights in --weights_dtype: the same start in every dtype
        unet.to(DTYPE_OF_NAME[args.weights_dtype])
    if row.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return unet.train()


def new_batch(unet: UNet2DConditionModel, args: argparse.Namespace, row: Row, device: torch.device | str) -> dict[str, torch.Tensor]:
    latent_side = args.resolution // 8
    batch = synthetic_batch(unet, list(range(row.batch_size)), SEED, height=latent_side, width=latent_side)
    return {key: value.to(device) for key, value in batch.items()}  # every key, item indices too, as the trainer moves them


def noise_scheduler() -> DDPMScheduler:
    return DDPMScheduler.from_config(SDXL_SCHEDULER_CONFIG)


def reference_loss(unet: torch.nn.Module, batch: dict[str, torch.Tensor], scheduler: DDPMScheduler) -> torch.Tensor:
    """The objective as a minimal loop writes it: noise and timesteps from the device's RNG, MSE to the noise."""
    latents = batch["latents"]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    prediction = unet(
        scheduler.add_noise(latents, noise, timesteps),
        timesteps,
        encoder_hidden_states=batch["prompt_embeds"],
        added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"], "time_ids": batch["time_ids"]},
    ).sample
    return F.mse_loss(prediction.float(), noise)


@functools.cache
def flop_per_image(model: str, resolution: int, gradient_checkpointing: bool) -> float:
    """FLOP of one training image (forward + backward at batch 1, recompute included), counted on the meta device."""
    args = argparse.Namespace(model=model, resolution=resolution, weights_dtype="fp32")  # FLOP do not depend on the weights dtype
    row = Row(1, gradient_checkpointing)
    unet = new_unet(args, row, "meta")
    batch = new_batch(unet, args, row, "meta")
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        reference_loss(unet, batch, noise_scheduler()).backward()
    return float(counter.get_total_flops())


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of several timed square matmuls: 8192^3 on a GPU, 1024^3 on the CPU."""
    side, repeats = (8192, 50) if device.type == "cuda" else (1024, 3)
    left, right = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    out = left @ right
    best = math.inf
    for _ in range(3 if device.type == "cpu" else 5):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(left, right, out=out)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * side**3 * repeats / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def param_dtype(compute_dtype: torch.dtype) -> torch.dtype | None:
    return None if compute_dtype == torch.float32 else compute_dtype


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    if name == TORCHAO_ADAMW8BIT:
        return TorchaoAdamW8bit(parameters, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    return build_optimizer(name, parameters, 1e-5, 1e-2, (0.9, 0.999), 1e-8)


def trainer_path(args: argparse.Namespace, row: Row, world: World, compute_dtype: torch.dtype) -> Callable[[int], object]:
    return build_trainer(args, row, world, compute_dtype)[1]


def build_trainer(args: argparse.Namespace, row: Row, world: World, compute_dtype: torch.dtype) -> tuple[torch.nn.Module, Callable[[int], object]]:
    """The UNet as the trainer prepares it, and one update of TrainStep over the synthetic batch (update number -> result)."""
    unet = prepare_unet(new_unet(args, row, world.device), world, param_dtype(compute_dtype), compile_blocks=args.compile, cpu_offload=args.cpu_offload)
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    optimizer = make_optimizer(args.optimizer, unet.parameters())
    step = TrainStep(
        unet,
        optimizer,
        LearningRateSchedule("constant", 1e-5, warmup_updates=0, total_updates=1),
        noise_scheduler(),
        NoiseSettings(conditional_dropout_percent=0.1),
        tuple(tensor.to(world.device) for tensor in empty_prompt_for(unet)),
        SEED,
        max_grad_norm=1.0,
        scaler=ShardedGradScaler(world.device.type) if compute_dtype == torch.float16 else None,
    )
    batch = new_batch(unet, args, row, world.device)
    return unet, lambda index: step([batch], epoch=index)


def reference_path(args: argparse.Namespace, row: Row, world: World, compute_dtype: torch.dtype, fsdp2: bool) -> Callable[[int], object]:
    unet = new_unet(args, row, world.device)
    if fsdp2:
        shard_unet(unet, world.mesh, param_dtype(compute_dtype), compile_blocks=args.compile)
    elif args.compile:
        compile_repeated_blocks(unet)
    optimizer = make_optimizer(args.optimizer, unet.parameters())
    # fp16 needs loss scaling; the sharded scaler also serves plain parameters.
    scaler = ShardedGradScaler(world.device.type) if compute_dtype == torch.float16 else None
    autocast = not fsdp2 and compute_dtype != torch.float32  # FSDP2's policy does the casting when sharded
    scheduler = noise_scheduler()
    batch = new_batch(unet, args, row, world.device)

    def step(index: int) -> None:
        with torch.autocast(world.device.type, dtype=compute_dtype, enabled=autocast):
            loss = reference_loss(unet, batch, scheduler)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def seconds_per_step(step: Callable[[int], object], args: argparse.Namespace, world: World) -> tuple[float, float | None]:
    """Mean seconds per step over the measured window, and of the first warm-up step alone (None without
    warm-up), each of the slowest rank."""
    backend = ATTENTION_BACKENDS[args.attention]
    first = None
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        for index in range(args.warmup_steps):
            started = time.perf_counter()
            step(index)
            if index == 0:
                synchronize(world.device)
                first = max(gather_floats(time.perf_counter() - started, world.device))
        synchronize(world.device)
        dist.barrier()
        started = time.perf_counter()
        for index in range(args.warmup_steps, args.warmup_steps + args.measured_steps):
            step(index)
        synchronize(world.device)
        elapsed = time.perf_counter() - started
    return max(gather_floats(elapsed, world.device)) / args.measured_steps, first


def optimizer_seconds(step: Callable[[int], object], args: argparse.Namespace, world: World) -> float | None:
    """Mean seconds of optimizer.step alone (the device synchronized before and after it), of the slowest
    rank, over OPTIMIZER_TIMED_STEPS more steps: its share of the step."""
    durations, started = [], []

    def before(*_) -> None:
        synchronize(world.device)
        started.append(time.perf_counter())

    def after(*_) -> None:
        synchronize(world.device)
        durations.append(time.perf_counter() - started[-1])

    hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        first = args.warmup_steps + args.measured_steps
        for index in range(first, first + OPTIMIZER_TIMED_STEPS):
            step(index)
    finally:
        for hook in hooks:
            hook.remove()
    means = gather_floats(sum(durations) / len(durations) if durations else math.nan, world.device)
    return None if any(math.isnan(mean) for mean in means) else max(means)


def profile_path(step: Callable[[int], object], name: str, args: argparse.Namespace, row: Row, world: World) -> None:
    """PROFILED_STEPS more steps under torch.profiler (rank 0's view): the operators that took the most device
    time (CPU time on a CPU) as a table, then the optimizer step's inclusive time, and where the time went
    (time_split) added to profiles.json."""
    on_gpu = world.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    first = args.warmup_steps + args.measured_steps + OPTIMIZER_TIMED_STEPS
    synchronize(world.device)
    with torch.profiler.profile(activities=activities) as profiler:
        started = time.perf_counter()
        for index in range(first, first + PROFILED_STEPS):
            step(index)
        synchronize(world.device)
        wall = time.perf_counter() - started
    if not world.is_main:
        return
    label = f"{name.split()[0]}_batch{row.batch_size}_ckpt{_on_off(row.gradient_checkpointing)}" + ("_compiled" if args.compile else "")
    args.profile.mkdir(parents=True, exist_ok=True)
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    averages = profiler.key_averages()
    # The optimizer step's self time is small (its kernels are its children), so under load its row can fall
    # out of the 40 above: its inclusive time follows on lines of its own.
    optimizer_lines = [
        f"{event.key}: {event.count} calls, {event.cpu_time_total / 1000:.1f} ms of host time in all"
        + (f", {event.device_time_total / 1000:.1f} ms of device time" if on_gpu else "")
        for event in averages if event.key.startswith(OPTIMIZER_EVENT)
    ]
    (args.profile / f"{label}.txt").write_text(averages.table(sort_by=sort_by, row_limit=40) + "\n" + "\n".join(optimizer_lines) + "\n")
    summaries_path = args.profile / "profiles.json"
    summaries = json.loads(summaries_path.read_text()) if summaries_path.exists() else {}
    summaries[label] = time_split(profiler.events(), PROFILED_STEPS, wall, on_gpu)
    summaries_path.write_text(json.dumps(summaries, indent=1) + "\n")
    print(f"  profile of {label}: {json.dumps(summaries[label])}", flush=True)


OPTIMIZER_EVENT = "Optimizer.step#"  # torch.optim records every step under this name, on the host and on the GPU


def time_split(events, steps: int, wall_seconds: float, on_gpu: bool) -> dict[str, float | None]:
    """Milliseconds per step, from the profiler's events: wall; the host's time in the optimizer step; the
    time some kernel ran (device busy; for the rest the GPU waited, for the CPU to launch work or on a host
    sync); the optimizer step as the GPU ran it (its span on the device timeline) and the kernel time inside
    that span. Kernels on several streams that overlap count once. On the CPU the device figures are None."""
    device = torch.autograd.DeviceType.CUDA
    kernels = [event.time_range for event in events if event.device_type == device and not event.is_user_annotation]
    on_host = [event.time_range for event in events if event.device_type != device and event.name.startswith(OPTIMIZER_EVENT)]
    on_gpu_timeline = [event.time_range for event in events if event.device_type == device and event.is_user_annotation and event.name.startswith(OPTIMIZER_EVENT)]
    per_step = 1e-3 / steps  # microseconds over all steps -> milliseconds per step
    optimizer_kernels = [(max(kernel.start, span.start), min(kernel.end, span.end)) for kernel in kernels for span in on_gpu_timeline]
    device_figures = {
        "device_busy_ms_per_step": covered_us([(kernel.start, kernel.end) for kernel in kernels]) * per_step,
        "kernels_per_step": len(kernels) / steps,
        "optimizer_device_ms_per_step": covered_us([(span.start, span.end) for span in on_gpu_timeline]) * per_step,
        "optimizer_kernel_ms_per_step": covered_us(optimizer_kernels) * per_step,
    }
    return {
        "steps": steps,
        "wall_ms_per_step": wall_seconds * 1e3 / steps,
        "optimizer_host_ms_per_step": covered_us([(span.start, span.end) for span in on_host]) * per_step,
        **{name: figure if on_gpu else None for name, figure in device_figures.items()},
    }


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """Time covered by any of the (start, end) intervals; empty ones (end <= start) cover nothing."""
    covered, reached = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > max(start, reached):
            covered += end - max(start, reached)
            reached = end
    return covered


def run_path(name: str, build: Callable[[], Callable[[int], object]], args: argparse.Namespace, row: Row, world: World) -> PathResult:
    """Build one path, time it and free it; a CUDA out-of-memory error makes the row read OOM."""
    if args.compile:
        torch._dynamo.reset()  # each path compiles its own graphs, within the recompile limit
    on_gpu = world.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(world.device)
    try:
        step = build()
        seconds, first = seconds_per_step(step, args, world)
        optimizer = optimizer_seconds(step, args, world)
        if args.profile:
            profile_path(step, name, args, row, world)
        del step
    except torch.OutOfMemoryError:
        seconds = first = optimizer = None  # the row reads OOM; the model is freed below, once the handler has dropped the traceback
    gc.collect()
    allocated = reserved = None
    if on_gpu:
        allocated = max(gather_floats(peak_memory_gib(world.device), world.device))
        reserved = max(gather_floats(torch.cuda.max_memory_reserved(world.device) / 2**30, world.device))
        torch.cuda.empty_cache()
    result = PathResult(row, name, seconds, first, optimizer, allocated, reserved)
    if world.is_main:
        speed = "OOM" if seconds is None else f"{row.batch_size / seconds:.3f} images/s"
        print(f"  batch {row.batch_size}, checkpointing {_on_off(row.gradient_checkpointing)}, {name}: {speed}", flush=True)
    return result


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _number(value: float | None, spec: str, missing: str) -> str:
    return missing if value is None else format(value, spec)


def table(results: list[PathResult], peak_flops: float, args: argparse.Namespace) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    references = {result.row: result for result in results if result.path.startswith("reference")}
    for result in results:
        row, seconds = result.row, result.seconds_per_step
        oom = seconds is None
        images_per_second = None if oom else row.batch_size / seconds
        mfu = None if oom else images_per_second * flop_per_image(args.model, args.resolution, row.gradient_checkpointing) / peak_flops * 100
        reference = references.get(row)
        ratio = None
        if not oom and reference is not None and reference.seconds_per_step is not None:
            ratio = seconds / reference.seconds_per_step
        cells = [
            str(row.batch_size),
            _on_off(row.gradient_checkpointing),
            result.path,
            _number(images_per_second, ".3f", "OOM"),
            _number(None if oom else seconds * 1000, ".1f", "OOM"),
            _number(None if result.optimizer_seconds is None else result.optimizer_seconds * 1000, ".1f", "OOM" if oom else "n/a"),
            _number(mfu, ".3g", "OOM"),  # 3 significant digits: tiny CPU runs are far below 1%
            _number(result.peak_allocated_gib, ".2f", "n/a"),  # on a GPU, an OOM row shows the peak it reached
            _number(result.peak_reserved_gib, ".2f", "n/a"),
            _number(ratio, ".3f", "OOM" if oom else "n/a"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread(s) per process)"


def driver_version(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True)
        return query.stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (nvidia-smi did not answer)"


def summary(args: argparse.Namespace, world: World, compute_dtype: torch.dtype, reference: str, peak_flops: float, rows: list[Row]) -> str:
    dtype = str(compute_dtype).removeprefix("torch.")
    latent = args.resolution // 8
    counted = {flag: flop_per_image(args.model, args.resolution, flag) / 1e12 for flag in sorted({row.gradient_checkpointing for row in rows})}
    counted_text = ", ".join(f"{value:.4g} with checkpointing {_on_off(flag)}" for flag, value in counted.items())
    nominal = ""
    if args.model == "sdxl" and args.resolution == 1024:
        nominal = f" (issue 7's nominal: {NOMINAL_TFLOP_1024[False]} off, {NOMINAL_TFLOP_1024[True]} on)"
    references = {
        "plain": "reference = plain nn.Module (under torch.autocast unless fp32), same batch, optimizer and checkpointing",
        "fsdp2": "reference = hand-written loop over the same FSDP2-sharded model, same batch, optimizer and checkpointing",
        "none": "no reference loop",
    }
    side = "8192" if world.device.type == "cuda" else "1024"
    return "\n".join(
        [
            f"- model: {args.model} UNet, random weights; {args.resolution} x {args.resolution} px (latents 4 x {latent} x {latent})",
            f"- {world.world_size} process(es) on {device_name(world.device)}; compute {dtype}; optimizer {args.optimizer}; "
            f"weights {args.weights_dtype}{'; CPU offload' if args.cpu_offload else ''}; compile {_on_off(args.compile)}; attention {args.attention}; {args.warmup_steps} warm-up + {args.measured_steps} measured steps per path",
            f"- trainer = TrainStep over the UNet as the trainer prepares it ({'FSDP2' if world.world_size > 1 else 'plain, autocast'}); {references[reference]}",
            f"- TFLOP per image, counted (forward + backward, recompute included): {counted_text}{nominal}",
            f"- peak: {peak_flops / 1e12:.4g} TFLOP/s, a {side}^3 {dtype} matmul timed on this device; MFU = images/s x FLOP per image / peak",
        ]
    )


def environment(world: World) -> str:
    launcher = f"torchrun, WORLD_SIZE={world.world_size}" if world.world_size > 1 else "1 process"
    cuda = f", CUDA {torch.version.cuda} (torch build)" if world.device.type == "cuda" else ""
    return "\n".join(
        [
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- device: {device_name(world.device)}; driver {driver_version(world.device)}{cuda}",
            f"- torch {torch.__version__}, diffusers {version('diffusers')}, torchao {version('torchao')}, python {platform.python_version()}",
            f"- command ({launcher}): `{shlex.join([Path(sys.executable).name, *sys.argv])}`",
        ]
    )


def write_json(path: Path, args: argparse.Namespace, world: World, compute_dtype: torch.dtype, peak_flops: float, results: list[PathResult]) -> None:
    rows = []
    for result in results:
        row = {**dataclasses.asdict(result.row), **{key: value for key, value in dataclasses.asdict(result).items() if key != "row"}}
        if result.seconds_per_step is not None:
            images_per_second = result.row.batch_size / result.seconds_per_step
            flop = flop_per_image(args.model, args.resolution, result.row.gradient_checkpointing)
            row.update(images_per_second=images_per_second, mfu=images_per_second * flop / peak_flops)
        rows.append(row)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": device_name(world.device), "driver": driver_version(world.device), "torch": torch.__version__,
        "processes": world.world_size, "compute_dtype": str(compute_dtype).removeprefix("torch."), "peak_flops": peak_flops,
        "settings": settings, "rows": rows,
    }, indent=1) + "\n")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = init_distributed()
    compute_dtype = resolve_compute_dtype(args.mixed_precision, world.device, args.weights_dtype)
    problems = check_args(args, world.world_size, world.device, compute_dtype)
    if problems:
        raise SystemExit("Cannot run the benchmark:\n  " + "\n  ".join(problems))
    reference = args.reference
    if reference == "auto":  # a plain loop over bf16 weights (no stochastic rounding) or offloaded ones is not a peer
        plain_peer = args.weights_dtype == "fp32" and not args.cpu_offload
        reference = ("plain" if world.world_size == 1 else "fsdp2") if plain_peer else "none"
    if world.device.type == "cuda":
        # As the trainer's --allow_tf32 default: TF32 for whatever fp32 matmuls and convolutions remain.
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    peak_flops = matmul_peak_flops(world.device, compute_dtype)
    if args.sweep:
        rows = [Row(batch_size, checkpointing) for checkpointing in (True, False) for batch_size in SWEEP_BATCH_SIZES]
    else:
        rows = [Row(args.batch_size, args.gradient_checkpointing)]
    results = []
    for row in rows:
        if reference != "none":
            build = functools.partial(reference_path, args, row, world, compute_dtype, fsdp2=reference == "fsdp2")
            results.append(run_path(f"reference ({reference})", build, args, row, world))
        build = functools.partial(trainer_path, args, row, world, compute_dtype)
        results.append(run_path("trainer", build, args, row, world))
    if world.is_main:
        report = summary(args, world, compute_dtype, reference, peak_flops, rows) + "\n\n" + table(results, peak_flops, args)
        if world.device.type != "cuda":
            report += f"\n\nCPU: no per-path memory figure; this process's peak resident size over the whole run was {peak_memory_gib(world.device):.2f} GiB."
        print(report)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            title = f"# Training throughput: {args.model} UNet, {args.resolution} px, {world.world_size} process(es)"
            args.output.write_text(f"{title}\n\n{environment(world)}\n{report}\n")
            print(f"Written to {args.output}")
        if args.json:
            write_json(args.json, args, world, compute_dtype, peak_flops, results)
            print(f"Written to {args.json}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
