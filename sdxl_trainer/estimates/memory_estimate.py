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

How the fake run is made to stand for a GPU run:
- Fake CPU tensors on a CPU device mesh, not fake CUDA tensors: the autograd engine asks for a CUDA context
  to run backward over CUDA tensors, which a machine without a GPU has not. FSDP2's buffers and the saved
  tensors of CPU attention have the sizes they have on a GPU.
- DTensor works out each operation's global output shape by running it in a fake mode. Under ours, those
  global-shape placeholders would be counted as if allocated (a sharded AdamW's state came out 3x too
  large); a tracing context carrying a separate fake mode gives DTensor its own (torch._guards.detect_fake_mode
  prefers a tracing context's), and the trackers skip what runs in another mode than theirs.
- Values read back to the host (a loss, a gradient norm, step counts, sample indices) do not exist; they
  read as 1, which keeps every update finite and stepped.
- The 8-bit AdamW step runs eagerly (torch.compile cannot trace under a dispatch mode), so its temporaries
  are those of separate operations: an upper bound of the compiled kernel's.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from diffusers import DDPMScheduler, UNet2DConditionModel
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from torch._C._distributed_c10d import FakeStore
except ImportError:  # torch before 2.12 (the lent GPUs' image has 2.11): importing its fake process group registers it
    from torch.testing._internal.distributed.fake_pg import FakeStore

from sdxl_trainer.distributed.fsdp import local_parameter_bytes, prepare_text_encoder, prepare_unet
from sdxl_trainer.distributed.world import World
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH, trainable_text_encoder
from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, SDXL_UNET_CONFIG, build_full_size_text_encoders, sdxl_tokenizers
from sdxl_trainer.optimizers.build import build_optimizer, local_optimizer_state_bytes
from sdxl_trainer.tools.speed_estimate import CollectiveBytes
from sdxl_trainer.training.captions import CaptionVariation, StepCaptionEncoder
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.lr_schedule import LearningRateSchedule
from sdxl_trainer.training.objective import NoiseSettings
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.trained_models import TrainedModels

GIB = 2**30
CARD_SIZES_GIB = (16, 24, 48, 80)
# What the trackers cannot see, added to their peak: the CUDA context and cuBLAS/cuDNN workspaces (about
# 0.5-1 GiB on recent GPUs), NCCL's communication buffers, and the caching allocator's unused reserve
# (fragmentation: bucket shapes change every step). Set to cover the reserved memory measured for every shipped
# config (one H200 capped at the card, without the expandable segments the trainer turns on, so an upper bound;
# benchmarks/results/2026-11-25-h200-memory.json): on one GPU 2.55-2.65 GiB over the tracked peak (5.42 GiB
# reserved at 2.87 tracked with --cpu_offload, 19.78 at 17.13 with bf16 weights); on several 23-49% of it, as
# FSDP's gathered weights and reduce-scatter buffers change size at every block (20.44 at 13.76 on 2 x 24 GB,
# 32.06 at 22.74 on 8 x 80 GB, 16.03 at 10.97 on 4 x 8 x 80 GB).
UNTRACKED_GIB = 2.5
UNTRACKED_SHARE = 0.10  # of the tracked peak, on one GPU
UNTRACKED_SHARE_SHARDED = 0.35  # on several GPUs
CATEGORIES = ("parameters", "gradients", "optimizer state", "EMA", "activations", "temporaries", "inputs")

# Tracker categories -> ours. All-gather outputs hold gathered weights, reduce-scatter inputs gradients.
_FSDP_CATEGORIES = {
    _FSDPRefType.SHARDED_PARAM: "parameters", _FSDPRefType.UNSHARDED_PARAM: "parameters", _FSDPRefType.BUFFER: "parameters",
    _FSDPRefType.ALL_GATHER: "parameters", _FSDPRefType.SHARDED_GRAD: "gradients", _FSDPRefType.UNSHARDED_GRAD: "gradients",
    _FSDPRefType.REDUCE_SCATTER: "gradients", _FSDPRefType.OPT: "optimizer state", _FSDPRefType.ACT: "activations",
    _FSDPRefType.TEMP: "temporaries", _FSDPRefType.INP: "inputs",
}  # fmt: skip
_PLAIN_CATEGORIES = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters", _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer state", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries", _MemRefType.OTH: "inputs",
}  # fmt: skip
# With FSDP2's CPU offload these live in host memory; everything else is on the GPU.
_OFFLOADED = (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT)


@dataclass(frozen=True)
class EstimateSettings:
    """The parts of a training configuration that decide its memory per GPU."""

    world_size: int  # GPUs of the run, all machines together
    train_batch_size: int
    gradient_accumulation_steps: int
    resolution: int  # side of the square bucket, the largest by pixel count (--max_resolution)
    compute_dtype: torch.dtype  # bf16/fp16 over fp32 weights, or fp32
    optimizer: str
    gradient_checkpointing: bool
    reshard_after_forward: bool
    reduce_every_microbatch: bool
    cpu_offload: bool
    use_ema: bool
    ema_on_cpu: bool
    weights_dtype: torch.dtype = torch.float32  # of the trained weights and their gradients (--weights_dtype)
    train_text_encoder: bool = False  # both text encoders trained too, captions encoded each step (caption mode)


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


class _PeakOfCounted:
    """What the estimate's trackers add to torch's: they keep the peak of the categories they count (all of
    them, or the GPU's share under CPU offload) and no per-module statistics, which cost a pass over every
    tracked module per operation (SDXL's UNet has about 2,000 modules)."""

    counted: tuple  # tracker categories on the GPU
    gpu_peak: int = 0
    gpu_peak_snapshot: dict = {}

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - the trackers' signature
        for snapshot in self._curr_mem_snap.values():
            counted = sum(snapshot[category] for category in self.counted)
            if counted > self.gpu_peak:
                self.gpu_peak = counted
                self.gpu_peak_snapshot = dict(snapshot)


class _ValuesReadAsOne(TorchDispatchMode):
    """A read of a fake tensor's value to the host gives 1: fake tensors hold no values, and the step reads a
    few (loss and gradient norm to decide on the step, step counts, sample indices for the noise). Every
    update is then finite and stepped."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


class _FSDPPeakTracker(_PeakOfCounted, FSDPMemTracker):
    def __init__(self, run: _Run):
        super().__init__(run.unet, run.optimizer)
        # Every FSDP module the run trains is instrumented (torch's tracker takes one FSDP root; the trained
        # text encoders are FSDP modules beside the UNet under TrainedModels).
        self._root_mod = run.trained
        self.microbatch_start = run.microbatch_start

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        tracked_pre_forward = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            # Each microbatch is a new iteration to the tracker, which refuses a second forward of a module
            # while its per-module statistics of the last one are kept.
            if fsdp_mod is self.microbatch_start and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            return tracked_pre_forward(*args, **kwargs)

        return pre_forward


class _PlainPeakTracker(_PeakOfCounted, MemTracker):
    def __init__(self, run: _Run):
        super().__init__()
        self.microbatch_start = run.microbatch_start
        self.track_external(run.trained, run.optimizer)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch's tracker hooks every parameter of a module for its gradient, and a frozen one (CLIP-L's last
        # layer, with trained text encoders) cannot take a hook: a module holding any frozen parameter installs
        # none, and its trainable parameters get theirs from the submodules that hold them.
        frozen = any(not parameter.requires_grad for parameter in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks and not frozen)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module is self.microbatch_start and not self._mod_tracker.is_bw:  # as _FSDPPeakTracker's pre_forward
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


@contextlib.contextmanager
def _fake_world(world_size: int, device: torch.device) -> Iterator[World]:
    """A process group of world_size ranks, this process rank 0, whose collectives move nothing: on a GPU,
    this process then holds what one GPU of the run holds (gathered buffers hold no real weights)."""
    if dist.is_initialized():
        raise RuntimeError("the memory estimate needs its own fake process group: run it outside a training run")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield World(0, world_size, 0, device, init_device_mesh(device.type, (world_size,)))
    finally:
        dist.destroy_process_group()


def _synthetic_microbatch(unet: UNet2DConditionModel, batch_size: int, resolution: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A cached batch's tensors for one microbatch (values do not matter to the estimate, only shapes)."""
    config = unet.config
    side = resolution // 8
    with torch.device(device):
        return {
            "latents": torch.zeros(batch_size, config.in_channels, side, side, dtype=torch.bfloat16),
            "prompt_embeds": torch.zeros(batch_size, TEXT_MAX_LENGTH, config.cross_attention_dim, dtype=torch.bfloat16),
            "pooled_prompt_embeds": torch.zeros(batch_size, _pooled_width(unet), dtype=torch.bfloat16),
            "time_ids": torch.full((batch_size, 6), float(resolution)),
            "sample_index": torch.arange(batch_size),
        }


# A caption of 74 words: with its start and end tokens it fills the 77 tokens that one text-encoder pass reads.
ESTIMATE_CAPTION = " ".join(["photo"] * 74)


@dataclass
class _Run:
    """One configuration built by the trainer's code, ready for _train_two_updates."""

    unet: torch.nn.Module
    trained: torch.nn.Module  # the UNet, or TrainedModels with the trained text encoders
    optimizer: torch.optim.Optimizer
    ema: ShardedEMA | None
    train_step: TrainStep
    microbatches: list[dict[str, torch.Tensor]]

    @property
    def microbatch_start(self) -> torch.nn.Module:
        """The first module a microbatch runs (the first of text encoder 1's FSDP modules, or the encoder itself
        when plain, in caption mode; else the UNet): where the trackers start a new iteration."""
        if self.trained is self.unet:
            return self.unet
        first_encoder = getattr(self.trained, TEXT_ENCODER_NAMES[0])
        return next((module for module in first_encoder.modules() if isinstance(module, FSDPModule)), first_encoder)


def _build_run(settings: EstimateSettings, world: World, unet_config: dict, text_encoder_builder: Callable[[], tuple] | None) -> _Run:
    with _default_dtype(settings.weights_dtype), world.device:  # Module.to() cannot swap fake parameters for others
        unet = UNet2DConditionModel(**unet_config)
    if settings.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    param_dtype = None if settings.compute_dtype == torch.float32 else settings.compute_dtype
    prepare_unet(unet, world, param_dtype, settings.reshard_after_forward, cpu_offload=settings.cpu_offload)
    trained, caption_encoder = unet, None
    if settings.train_text_encoder:
        # As the trainer's caption mode with --train_text_encoder: both encoders trained at the UNet's rate.
        with _default_dtype(settings.weights_dtype), world.device:
            encoders = (text_encoder_builder or build_full_size_text_encoders)()
        for encoder in encoders:
            trainable_text_encoder(encoder, settings.gradient_checkpointing)
            prepare_text_encoder(encoder, world, param_dtype, settings.reshard_after_forward, cpu_offload=settings.cpu_offload)
        trained = TrainedModels(unet, dict(zip(TEXT_ENCODER_NAMES, encoders)))
        caption_encoder = StepCaptionEncoder((sdxl_tokenizers(), encoders), [ESTIMATE_CAPTION], CaptionVariation(), 0, 1, world.device, trains=True)
    groups = trained.parameter_groups(1e-5, dict.fromkeys(TEXT_ENCODER_NAMES, 1e-5)) if trained is not unet else unet.parameters()
    optimizer = build_optimizer(settings.optimizer, groups, 1e-5, 1e-2, (0.9, None), 1e-8, loss_scaling=settings.compute_dtype == torch.float16)
    ema = ShardedEMA(unet, 0.9999, on_cpu=settings.ema_on_cpu) if settings.use_ema else None
    empty_prompt = (torch.zeros(TEXT_MAX_LENGTH, unet.config.cross_attention_dim), torch.zeros(_pooled_width(unet)))
    train_step = TrainStep(
        unet, optimizer, LearningRateSchedule("constant", 1e-5, 0, 1), _training_scheduler(),
        NoiseSettings(conditional_dropout_percent=0.1), tuple(tensor.to(world.device) for tensor in empty_prompt), run_seed=0,
        max_grad_norm=1.0, ema=ema, reduce_every_microbatch=settings.reduce_every_microbatch, caption_encoder=caption_encoder,
    )  # fmt: skip
    # A microbatch past the second adds nothing new: its gradients land where the second's did.
    microbatches = [
        _synthetic_microbatch(unet, settings.train_batch_size, settings.resolution, world.device)
        for _ in range(min(settings.gradient_accumulation_steps, 2))
    ]
    return _Run(unet, trained, optimizer, ema, train_step, microbatches)


def _zero_gradients(run: _Run) -> None:
    """Gradients as backward leaves them, for _train_two_updates' first update. Made before a tracker starts,
    which then counts them as gradients (on the host under CPU offload, where FSDP2 keeps them); made under
    it, they would count as activations on the GPU."""
    for parameter in run.trained.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)


def _train_two_updates(run: _Run, device: torch.device) -> tuple[bool, float]:
    """The first update only steps the optimizer, on the zero gradients of _zero_gradients: it creates the
    optimizer's state as a first update does (its forward and backward, without that state, need less than
    the second's, and cost as much time on fake tensors as a whole update). The second is a whole update.
    Returns whether the second stepped (a non-finite loss or gradient norm skips the step), and its seconds."""
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    started = time.perf_counter()
    result = run.train_step(run.microbatches, epoch=0)
    _synchronize(device)
    return result.stepped, time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def estimate_memory(
    settings: EstimateSettings, unet_config: dict | None = None, fake: bool = True, text_encoder_builder: Callable[[], tuple] | None = None
) -> MemoryEstimate:
    """Train `settings` on fake tensors (see the module docstring) and return the per-GPU peak by category.
    unet_config / text_encoder_builder: the UNet and (with settings.train_text_encoder) text encoders to build
    (default SDXL's). fake=False runs the same on real tensors, where the truth is known (the tests compare
    both on the tiny model)."""
    unet_config = unet_config or SDXL_UNET_CONFIG
    tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with _fake_world(settings.world_size, torch.device("cpu")) as world, tensors, tracing(TracingContext(FakeTensorMode())):
        run = _build_run(settings, world, unet_config, text_encoder_builder)
        unet, optimizer, ema = run.unet, run.optimizer, run.ema
        sharded = isinstance(unet, FSDPModule)
        _zero_gradients(run)
        tracker = _FSDPPeakTracker(run) if sharded else _PlainPeakTracker(run)
        categories = _FSDP_CATEGORIES if sharded else _PLAIN_CATEGORIES
        tracker.counted = tuple(category for category in categories if not (settings.cpu_offload and category in _OFFLOADED))
        with tracker, _ValuesReadAsOne():
            _train_two_updates(run, world.device)
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
        ema_bytes = sum(shadow.numel() * shadow.element_size() for shadow in ema.shadow) if ema is not None else 0
        ema_on_host = settings.ema_on_cpu or settings.cpu_offload
        by_category["EMA"] = 0 if ema_on_host else ema_bytes  # made before tracking, alive throughout
        host_bytes = ema_bytes if ema_on_host else 0
        if settings.cpu_offload:
            host_bytes += 2 * local_parameter_bytes(run.trained) + state_bytes  # weights and gradients (in the weights' dtype), the optimizer's state
        return MemoryEstimate(settings, by_category, host_bytes, sum(parameter.numel() for parameter in unet.parameters()),
                              sum(parameter.numel() for parameter in run.trained.parameters() if parameter.requires_grad))  # fmt: skip


def count_collectives(settings: EstimateSettings, unet_config: dict | None = None) -> CollectiveBytes:
    """What one rank's collectives move in estimate_memory's two updates, on fake tensors over the fake process
    group (its first update, the optimizer's alone, moves nothing): the speed estimate's byte count, checked at
    full size by tests/test_speed_estimate.py."""
    with _fake_world(settings.world_size, torch.device("cpu")) as world, FakeTensorMode(allow_non_fake_inputs=True), tracing(TracingContext(FakeTensorMode())):
        run = _build_run(settings, world, unet_config or SDXL_UNET_CONFIG, None)
        _zero_gradients(run)
        with CollectiveBytes() as counted, _ValuesReadAsOne():
            _train_two_updates(run, world.device)
    return counted


@dataclass
class MeasuredMemory:
    """What one GPU really held for a configuration (measure_memory): torch's allocator statistics."""

    peak_allocated: int  # bytes: torch.cuda.max_memory_allocated over both updates
    peak_reserved: int  # bytes: the caching allocator's peak, fragmentation included
    stepped: bool  # False: the second update was skipped (non-finite), so its step's temporaries are missing
    update_seconds: float | None  # the second (whole) update, compiled already by the first; None: out of memory

    @property
    def out_of_memory(self) -> bool:
        """The run did not fit under the cap."""
        return self.update_seconds is None


def measure_memory(settings: EstimateSettings, device: torch.device, cap_gib: float | None = None, unet_config: dict | None = None) -> MeasuredMemory:
    """The estimate's two updates for real on one GPU, which holds what one GPU of a `settings.world_size`
    run holds (a fake process group: collectives move nothing, so a sharded run's gathered weights are not
    real ones and its loss may come out non-finite; `stepped` says so). The peak counts from after the model
    is built and prepared, as the estimate's does; cap_gib limits what the process may allocate
    (torch.cuda.set_per_process_memory_fraction), as on a card of that size."""
    with _fake_world(settings.world_size, device) as world:
        run = _build_run(settings, world, unet_config or SDXL_UNET_CONFIG, None)
        _zero_gradients(run)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        if cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(min(cap_gib * GIB / torch.cuda.get_device_properties(device).total_memory, 1.0), device)
        stepped, update_seconds = False, None
        try:
            stepped, update_seconds = _train_two_updates(run, device)
        except torch.OutOfMemoryError:
            pass
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        measured = MeasuredMemory(*peaks, stepped, update_seconds)
        del run
        torch.cuda.empty_cache()
        return measured


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _training_scheduler() -> DDPMScheduler:
    """SDXL's training noise schedule (its values do not change the memory)."""
    schedule = ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "prediction_type")
    return DDPMScheduler(**{name: SDXL_SCHEDULER_CONFIG[name] for name in schedule})


def _pooled_width(unet: UNet2DConditionModel) -> int:
    config = unet.config
    return config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim


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
