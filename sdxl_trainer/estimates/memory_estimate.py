"""Per-GPU memory of a training configuration at full SDXL size, estimated on any machine, no GPU needed.

The trainer's own code builds the full-size UNet and trains it (prepare_unet with its sharding, mixed
precision, gradient checkpointing and CPU offload; build_optimizer; TrainStep with its microbatches and
gradient reduction; ShardedEMA; with --train_text_encoder both full-size text encoders, prepared as the
trainer prepares them and encoding 75-token captions each step through StepCaptionEncoder) for two
updates, the first of which only creates the optimizer's state, on
fake tensors (FakeTensorMode: shapes, dtypes and strides, no storage) over a fake process group of the
requested size (collectives that move nothing). torch's FSDPMemTracker (MemTracker for one process's
plain module) counts every tensor that would be alive, by category, and the estimate keeps the peak. What
no tracker sees is added as a stated margin
(UNTRACKED_GIB + UNTRACKED_SHARE): the CUDA context, NCCL's buffers, cuDNN workspaces and the caching
allocator's fragmentation.
How the fake run stands for a GPU run: fake_run.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from sdxl_trainer.distributed.fsdp import local_parameter_bytes
from sdxl_trainer.estimates.fake_run import EstimateSettings, ValuesReadAsOne, build_estimate_run, fake_world, train_two_updates, zero_gradients
from sdxl_trainer.estimates.memory_trackers import CATEGORIES, FSDP_CATEGORIES, OFFLOADED, PLAIN_CATEGORIES, FSDPPeakTracker, PlainPeakTracker
from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG
from sdxl_trainer.optimizers.build import local_optimizer_state_bytes

GIB = 2**30
CARD_SIZES_GIB = (16, 24, 48, 80)
# What the trackers cannot see, added to their peak: the CUDA context and cuBLAS/cuDNN workspaces, NCCL's
# communication buffers, and the caching allocator's unused reserve (fragmentation: bucket shapes change every
# step). Set to cover the reserved memory measured for every shipped config (one H200 capped at the card,
# without the expandable segments the trainer turns on, so an upper bound): on one GPU a fixed amount over the
# tracked peak covered it, on several a share of the peak, as FSDP's gathered weights and reduce-scatter
# buffers change size at every block. Each config's estimate beside its measured reserved memory: README.md,
# "Configs and hardware" (benchmarks/results/2026-11-25-h200-memory.json); the margin: docs/memory.md.
UNTRACKED_GIB = 2.5
UNTRACKED_SHARE = 0.10  # of the tracked peak, on one GPU
UNTRACKED_SHARE_SHARDED = 0.35  # on several GPUs


def untracked_share(world_size: int) -> float:
    return UNTRACKED_SHARE_SHARDED if world_size > 1 else UNTRACKED_SHARE


def needed_gib(tracked_gib: float, world_size: int) -> float:
    """A tracked peak per GPU (GiB) with the margin for what no tracker sees, on `world_size` GPUs."""
    return tracked_gib * (1 + untracked_share(world_size)) + UNTRACKED_GIB


@dataclass
class MemoryEstimate:
    settings: EstimateSettings
    gpu_peak_by_category: dict[str, int]  # bytes at the GPU's peak, by CATEGORIES
    host_bytes: int  # host memory the run keeps for the whole run: offloaded state (pinned), an EMA on the CPU
    unet_parameters: int
    trained_parameters: int  # the UNet's, and the trained text encoders' (without CLIP-L's frozen last layer)

    @property
    def gpu_peak(self) -> int:
        return sum(self.gpu_peak_by_category.values())

    @property
    def gpu_needed_gib(self) -> float:
        """The tracked peak with the margin for what no tracker sees."""
        return needed_gib(self.gpu_peak / GIB, self.settings.world_size)

    def fits(self, card_gib: float) -> bool:
        # A card's usable memory: "24 GB" cards (RTX 3090/4090) have 24 GiB, of which the driver keeps some.
        return self.gpu_needed_gib <= card_gib * 0.97

    def report(self) -> str:
        settings = self.settings
        lines = [
            f"Estimated memory per GPU: full-size SDXL UNet ({self.unet_parameters / 1e9:.2f} B parameters)"
            + (f" and both text encoders ({(self.trained_parameters - self.unet_parameters) / 1e9:.2f} B trained)" if settings.train_text_encoder else "")
            + f", {settings.world_size} "
            f"GPU{'s' if settings.world_size > 1 else ''}, batch {settings.train_batch_size} x {settings.gradient_accumulation_steps} "
            f"accumulation at {settings.resolution}x{settings.resolution} px, {settings.optimizer}, "
            f"compute {str(settings.compute_dtype).removeprefix('torch.')}"
            + (", bf16 weights" if settings.weights_dtype == torch.bfloat16 else "")
            + f", gradient checkpointing {'on' if settings.gradient_checkpointing else 'off'}"
            + (", gradients reduced every microbatch" if settings.reduce_every_microbatch and settings.gradient_accumulation_steps > 1 else "")
            + (", optimizer stepped in backward" if settings.optimizer_in_backward else "")
            + (f", UNet blocks {', '.join(str(block) for block, rate in enumerate(settings.block_lr) if rate == 0)} frozen" if settings.block_lr and 0 in settings.block_lr else "")
            + (", CPU offload" if settings.cpu_offload else "")
            + (f", EMA{' on the CPU' if settings.ema_on_cpu else ''}" if settings.use_ema else "")
            + ":"
        ]
        for category in CATEGORIES:
            lines.append(f"  {category:<16} {self.gpu_peak_by_category[category] / GIB:7.2f} GiB")
        lines.append(f"  {'tracked peak':<16} {self.gpu_peak / GIB:7.2f} GiB")
        lines.append(
            f"  {'with margin':<16} {self.gpu_needed_gib:7.2f} GiB  (+{untracked_share(settings.world_size):.0%} + {UNTRACKED_GIB} GiB for the "
            "CUDA context, NCCL buffers, workspaces and fragmentation, which no tracker sees)"
        )
        if self.host_bytes:
            what = "the offloaded weights, gradients and optimizer state (pinned)" if settings.cpu_offload else "the EMA"
            lines.append(f"  host RAM per GPU {self.host_bytes / GIB:7.2f} GiB  for {what}; add the data loader and the OS")
        fits = [f"{size} GB {'fits' if self.fits(size) else 'does not fit'}" for size in CARD_SIZES_GIB]
        lines.append("  cards: " + ", ".join(fits))
        return "\n".join(lines)


def estimate_memory(
    settings: EstimateSettings, unet_config: dict | None = None, fake: bool = True, text_encoder_builder: Callable[[], tuple] | None = None
) -> MemoryEstimate:
    """Train `settings` on fake tensors (see the module docstring) and return the per-GPU peak by category.
    unet_config / text_encoder_builder: the UNet and (with settings.train_text_encoder) text encoders to build
    (default SDXL's). fake=False runs the same on real tensors, where the truth is known (the tests compare
    both on the tiny model)."""
    unet_config = unet_config or SDXL_UNET_CONFIG
    tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with fake_world(settings.world_size, torch.device("cpu")) as world, tensors, tracing(TracingContext(FakeTensorMode())):
        run = build_estimate_run(settings, world, unet_config, text_encoder_builder)
        unet, optimizer, ema = run.unet, run.optimizer, run.ema
        sharded = isinstance(unet, FSDPModule)
        zero_gradients(run)
        tracker = FSDPPeakTracker(run) if sharded else PlainPeakTracker(run)
        categories = FSDP_CATEGORIES if sharded else PLAIN_CATEGORIES
        tracker.counted = tuple(category for category in categories if not (settings.cpu_offload and category in OFFLOADED))
        with tracker, ValuesReadAsOne():
            train_two_updates(run, world.device)
        by_category = dict.fromkeys(CATEGORIES, 0)
        for category, size in tracker.gpu_peak_snapshot.items():
            if category in tracker.counted:
                by_category[categories[category]] += size
        state_bytes = local_optimizer_state_bytes(optimizer)
        if not settings.cpu_offload:
            # The optimizer category holds the step's temporaries too: keep the state itself apart.
            step_temporaries = max(by_category["optimizer state"] - state_bytes, 0)
            by_category["optimizer state"] -= step_temporaries
            by_category["temporaries"] += step_temporaries
        ema_bytes = ema.bytes_held() if ema is not None else 0
        ema_on_host = settings.ema_on_cpu or settings.cpu_offload
        by_category["EMA"] = 0 if ema_on_host else ema_bytes  # made before tracking, alive throughout
        host_bytes = ema_bytes if ema_on_host else 0
        if settings.cpu_offload:
            host_bytes += 2 * local_parameter_bytes(run.trained) + state_bytes  # weights and gradients (in the weights' dtype), the optimizer's state
        return MemoryEstimate(settings, by_category, host_bytes, sum(parameter.numel() for parameter in unet.parameters()),
                              sum(parameter.numel() for parameter in run.trained.parameters() if parameter.requires_grad))  # fmt: skip


def print_memory_estimate(loads: list[EstimateSettings]) -> None:
    """--estimate_memory: each load's peak per GPU at full SDXL size (rank 0 prints). Several loads are the
    card sizes that --gradient_reduction auto treats differently (jobs.train_config.memory_settings)."""
    if os.environ.get("RANK", "0") != "0":
        return
    gpus = loads[0].world_size
    print(f"Estimating on fake tensors (no GPU needed; a few minutes on a CPU) for {gpus} GPU{'s' if gpus > 1 else ''}...", flush=True)
    for settings in loads:
        started = time.perf_counter()
        estimate = estimate_memory(settings)
        if len(loads) > 1:
            every = settings.reduce_every_microbatch
            cards = "Cards under 40 GB" if every else "Cards of 40 GB and more"
            print(f"{cards} reduce gradients {'every microbatch' if every else 'once per update'} (--gradient_reduction auto):")
        print(estimate.report() + f"\n  (estimated in {time.perf_counter() - started:.0f} s)")
