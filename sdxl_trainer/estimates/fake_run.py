"""One training configuration built by the trainer's own code (prepare_unet, build_optimizer, TrainStep,
ShardedEMA, the caption encoder) over a process group whose collectives move nothing, and its two updates:
the harness of the memory estimate (on fake tensors), its measurement on a GPU (real tensors) and the
collective count.

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
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from diffusers import DDPMScheduler, UNet2DConditionModel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from torch._C._distributed_c10d import FakeStore
except ImportError:  # torch before 2.12 (the lent GPUs' image has 2.11): importing its fake process group registers it
    from torch.testing._internal.distributed.fake_pg import FakeStore

from sdxl_trainer.distributed.fsdp import prepare_text_encoder, prepare_unet
from sdxl_trainer.distributed.world import World
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH, trainable_text_encoder
from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, build_full_size_text_encoders, sdxl_tokenizers
from sdxl_trainer.optimizers.build import build_optimizer, evaluation_weights_of
from sdxl_trainer.training.block_rates import block_count_problem, freeze_zero_rate_blocks
from sdxl_trainer.training.captions import CaptionVariation, StepCaptionEncoder
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.lr_schedule import LearningRateSchedule
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.trained_models import TrainedModels


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
    reduce_dtype: torch.dtype = torch.float32  # of the reduce-scattered gradients (--reduce_dtype)
    optimizer_in_backward: bool = False  # each unit stepped, and its gradients freed, inside backward (no clipping, one microbatch)
    block_lr: tuple[float, ...] | None = None  # --block_lr: its blocks at 0 frozen (no gradient, no optimizer state)


class ValuesReadAsOne(TorchDispatchMode):
    """A read of a fake tensor's value to the host gives 1: fake tensors hold no values, and the step reads a
    few (loss and gradient norm to decide on the step, step counts, sample indices for the noise). Every
    update is then finite and stepped."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_world(world_size: int, device: torch.device) -> Iterator[World]:
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
class EstimateRun:
    """One configuration built by the trainer's code, ready for train_two_updates."""

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


def build_estimate_run(settings: EstimateSettings, world: World, unet_config: dict, text_encoder_builder: Callable[[], tuple] | None) -> EstimateRun:
    with _default_dtype(settings.weights_dtype), world.device:  # Module.to() cannot swap fake parameters for others
        unet = UNet2DConditionModel(**unet_config)
    problem = block_count_problem(settings.block_lr, unet_config)
    if problem:
        raise SystemExit(problem)
    freeze_zero_rate_blocks(unet, settings.block_lr)  # as the trainer does, before the UNet is prepared
    if settings.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    param_dtype = None if settings.compute_dtype == torch.float32 else settings.compute_dtype
    prepare_unet(unet, world, param_dtype, settings.reshard_after_forward, cpu_offload=settings.cpu_offload, reduce_dtype=settings.reduce_dtype)
    trained, caption_encoder = unet, None
    if settings.train_text_encoder:
        # As the trainer's caption mode with --train_text_encoder: both encoders trained at the UNet's rate.
        with _default_dtype(settings.weights_dtype), world.device:
            encoders = (text_encoder_builder or build_full_size_text_encoders)()
        for encoder in encoders:
            trainable_text_encoder(encoder, settings.gradient_checkpointing)
            prepare_text_encoder(encoder, world, param_dtype, settings.reshard_after_forward, cpu_offload=settings.cpu_offload, reduce_dtype=settings.reduce_dtype)
        trained = TrainedModels(unet, dict(zip(TEXT_ENCODER_NAMES, encoders)))
        caption_encoder = StepCaptionEncoder((sdxl_tokenizers(), encoders), [ESTIMATE_CAPTION], CaptionVariation(), 0, 1, world.device, trains=True)
    block_rates = list(settings.block_lr) if settings.block_lr else None
    if trained is unet:
        groups = [parameter for parameter in unet.parameters() if parameter.requires_grad]
    else:
        groups = trained.parameter_groups(1e-5, dict.fromkeys(TEXT_ENCODER_NAMES, 1e-5), block_rates)
    optimizer = build_optimizer(settings.optimizer, groups, 1e-5, 1e-2, (0.9, None), 1e-8)
    ema = ShardedEMA(unet, 0.9999, on_cpu=settings.ema_on_cpu, evaluation_weights=evaluation_weights_of(optimizer)) if settings.use_ema else None
    empty_prompt = (torch.zeros(TEXT_MAX_LENGTH, unet.config.cross_attention_dim), torch.zeros(_pooled_width(unet)))
    train_step = TrainStep(
        unet, optimizer, LearningRateSchedule("constant", 1e-5, 0, 1), _training_scheduler(),
        NoiseSettings(conditional_dropout_percent=0.1), tuple(tensor.to(world.device) for tensor in empty_prompt), run_seed=0,
        max_grad_norm=0.0 if settings.optimizer_in_backward else 1.0, ema=ema, reduce_every_microbatch=settings.reduce_every_microbatch,
        caption_encoder=caption_encoder, gather_once_per_update=not settings.reshard_after_forward, optimizer_in_backward=settings.optimizer_in_backward,
    )  # fmt: skip
    # A microbatch past the second adds nothing new: its gradients land where the second's did.
    microbatches = [
        _synthetic_microbatch(unet, settings.train_batch_size, settings.resolution, world.device)
        for _ in range(min(settings.gradient_accumulation_steps, 2))
    ]
    return EstimateRun(unet, trained, optimizer, ema, train_step, microbatches)


def zero_gradients(run: EstimateRun) -> None:
    """Gradients as backward leaves them, for train_two_updates' first update. Made before a tracker starts,
    which then counts them as gradients (on the host under CPU offload, where FSDP2 keeps them); made under
    it, they would count as activations on the GPU. With the optimizer in backward none: its first update makes
    each unit's as it steps that unit (a GPU never holds them all)."""
    if run.train_step.in_backward is not None:
        return
    for parameter in run.trained.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)


def train_two_updates(run: EstimateRun, device: torch.device) -> tuple[bool, float]:
    """The first update only steps the optimizer, on the zero gradients of zero_gradients: it creates the
    optimizer's state as a first update does (its forward and backward, without that state, need less than
    the second's, and cost as much time on fake tensors as a whole update). The second is a whole update.
    Returns whether the second stepped (a non-finite loss or gradient norm skips the step), and its seconds.
    With the optimizer in backward the first steps unit by unit on each unit's zero gradients, freed after its
    step as backward would free them, and lays the state out as those updates use it."""
    in_backward = run.train_step.in_backward
    if in_backward is None:
        run.optimizer.step()
    else:
        for unit, subset in zip(in_backward.units, in_backward.subsets):
            for parameter in unit:
                parameter.grad = torch.zeros_like(parameter)
            in_backward.optimizer.step_subset(subset)
            for parameter in unit:
                parameter.grad = None
    run.optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    started = time.perf_counter()
    result = run.train_step(run.microbatches, epoch=0)
    _synchronize(device)
    return result.stepped, time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
