"""Time per update of a training configuration on named hardware, predicted on any machine (no GPU needed):
--estimate_speed --gpu h100|h200|a100|4090|3090 --interconnect nvlink4|nvlink3|pcie4|pcie4_x8|pcie4_x4|pcie5|ib400|eth100.

What it adds up, per FSDP2 unit of the UNet as distributed/fsdp.shard_unet wraps it (the root, each down / mid
/ up block, each transformer block), in the order the forward reaches them:
- compute: each unit's share of a microbatch's time on one GPU. Until the GPU battery measures units one by
  one, that time is the whole UNet's, measured on an H200 (benchmarks/results/2026-11-27-h200-gpu_check.json:
  the trainer's step at batch 1, 4 and 8, less its optimizer step), split over the units by their FLOP (counted
  on the meta device); another GPU's is scaled by its published peak bf16 FLOP/s. A microbatch is never faster
  than the H200's batch-1 time: the host's work (launching kernels) sets a floor that a faster GPU or a smaller
  batch does not lower, and it is taken to be the same on every machine.
- communication, as FSDP2 issues it (docs/design.md §15): each unit's weights all-gathered in the compute
  dtype before its forward, and again before its backward with --reshard_after_forward (but the root's, which
  stays gathered); without it, once per update (kept gathered from one microbatch to the next); its gradients
  reduce-scattered in fp32 after its backward, on every microbatch or on the last (--gradient_reduction); with
  HSDP (--replicate_groups) the reduced shards all-reduced across the groups. Shards are padded as FSDP2 pads
  them (dim 0 to a multiple of the shard count). A collective of N bytes over p GPUs takes (p - 1) / p x N (an
  all-reduce twice that) at the link's bandwidth (NCCL's ring).
- overlap: one stream computes, one communicates (in the order the collectives are issued); a unit computes
  once its weights are gathered, and the next unit's gather starts as soon as the link is free once this
  unit's compute has started (FSDP2's prefetch); a unit's reduce-scatter follows its backward.
- the optimizer step: the larger of its memory traffic (STEP_BYTES a value of the rank's shard: 16 for the 8-bit
  AdamW) at the GPU's bandwidth and the host time measured on the H200 for the 8-bit AdamW step (host-bound; the
  other optimizers' host time is not measured, and this floor stands in for it). Prodigy's all-reduce of two
  numbers per update is latency only, not counted. Adafactor's and CAME's steps have not run on a GPU: the
  larger of their own memory traffic and their operators (counted per run of same-shaped tensors, over
  shards or whole tensors, FACTORED_STEP_WORK) at the host time per kernel of the H200's host-bound batch-1
  update (that update's time over the kernels its profile counted, H200_PROFILES); their all-reduces of
  column statistics (a few MB) are left out.
Nothing else (data loading, logging, saves) is counted: the battery's end-to-end part measures that.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sdxl_trainer.optimizers.shards import FACTORED_RUN_VALUES, runs_of_at_most

REPO_ROOT = Path(__file__).resolve().parents[2]
H200_MEASUREMENT = REPO_ROOT / "benchmarks" / "results" / "2026-11-27-h200-gpu_check.json"
H200_PROFILES = REPO_ROOT / "benchmarks" / "results" / "2026-11-27-h200-run2-profiles.json"
H200_PEAK_BF16 = 989e12


@dataclass(frozen=True)
class GpuSpec:
    peak_bf16_flops: float  # dense tensor-core FLOP/s, fp32 accumulation, no sparsity
    memory_bandwidth: float  # bytes/s
    memory_gib: int
    intra_node_link: str  # what links the GPUs of one machine (HSDP's shard groups)
    source: str


GPUS = {
    "h200": GpuSpec(989e12, 4.8e12, 141, "nvlink4", "NVIDIA H200 SXM (the H100's GH100 die: 1,979 TFLOP/s with sparsity)"),
    "h100": GpuSpec(989e12, 3.35e12, 80, "nvlink4", "NVIDIA H100 SXM datasheet (1,979 with sparsity, half without)"),
    "a100": GpuSpec(312e12, 2.039e12, 80, "nvlink3", "NVIDIA A100 SXM 80GB datasheet"),
    "4090": GpuSpec(165e12, 1.008e12, 24, "pcie4", "Ada whitepaper, RTX 4090 (330 with fp16 accumulation or sparsity); no GPU-to-GPU P2P"),
    "3090": GpuSpec(71e12, 0.936e12, 24, "pcie4", "GA102 whitepaper, RTX 3090 (142 with fp16 accumulation)"),
}


@dataclass(frozen=True)
class LinkSpec:
    bytes_per_second: float  # per GPU and direction, as the link is sold
    efficiency: float  # the share NCCL's rings reach (its "bus bandwidth")
    source: str

    @property
    def bandwidth(self) -> float:
        return self.bytes_per_second * self.efficiency


LINKS = {
    "nvlink4": LinkSpec(450e9, 0.82, "900 GB/s both ways per H100/H200; NCCL's busbw about 370 GB/s (nccl-tests #212)"),
    "nvlink3": LinkSpec(300e9, 0.80, "600 GB/s both ways per A100 (assumed: NCCL's share as NVLink4's)"),
    "pcie4": LinkSpec(31.5e9, 0.70, "PCIe 4.0 x16, 16 GT/s x 128b/130b (NCCL's share assumed; without P2P, as on RTX 4090s, through host memory: less)"),
    "pcie4_x8": LinkSpec(15.75e9, 0.70, "PCIe 4.0 x8: two cards on a desktop board's CPU lanes, split x8/x8 (NCCL's share assumed)"),
    "pcie4_x4": LinkSpec(7.9e9, 0.70, "PCIe 4.0 x4: a desktop board's second slot wired to the chipset (NCCL's share assumed)"),
    "pcie5": LinkSpec(63e9, 0.70, "PCIe 5.0 x16 (NCCL's share assumed)"),
    "ib400": LinkSpec(50e9, 0.90, "InfiniBand NDR 400 Gb/s per GPU (NCCL's share assumed)"),
    "eth100": LinkSpec(12.5e9, 0.80, "100 Gb Ethernet (NCCL's share assumed)"),
}


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: its name, its parameters' shapes, and its forward FLOP per image."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    forward_flop: float

    def padded_values(self, shards: int) -> int:
        """Values one rank holds of this unit: each parameter's dim 0 padded to a multiple of `shards`."""
        return sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in self.shapes)


@dataclass(frozen=True)
class SpeedSettings:
    gpus: int
    replicate_groups: int
    train_batch_size: int
    gradient_accumulation_steps: int
    resolution: int
    compute_bytes: int  # 2 (bf16 / fp16) or 4 (fp32): what the weights are gathered in
    gradient_checkpointing: bool
    reshard_after_forward: bool
    reduce_every_microbatch: bool
    gpu: str
    interconnect: str
    reduce_bytes: int = 4  # 4 (fp32) or 2 (bf16): what the gradients are reduce-scattered in (--reduce_dtype)
    optimizer: str = "adamw8bit"  # --optimizer: its step's memory traffic (STEP_BYTES; Adafactor's and CAME's work apart, optimizer_seconds)

    @property
    def shard_group(self) -> int:
        return self.gpus // self.replicate_groups


def fsdp_units(unet: nn.Module) -> list[nn.Module]:
    """The modules shard_unet makes FSDP2 units of, the root first: each transformer block (or the checkpoint
    wrapper around it), each down / mid / up block, the UNet."""
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [module for module in unet.modules() if isinstance(module, BasicTransformerBlock)]
    return [unet, *unet.down_blocks, unet.mid_block, *unet.up_blocks, *blocks]


def units_of(unet: nn.Module, resolution: int) -> list[Unit]:
    """The UNet's FSDP2 units in the order its forward reaches them, with their parameters (those of nested
    units left out) and forward FLOP per image (counted on the meta device: the unit's own, nested units' out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    modules = fsdp_units(unet)
    names = {module: name for name, module in unet.named_modules()}
    owner: dict[int, nn.Module] = {}
    for module in sorted(modules, key=lambda module: -len(names[module])):  # the innermost unit claims a parameter first
        for parameter in module.parameters():
            owner.setdefault(id(parameter), module)
    if not next(unet.parameters()).is_meta:
        raise ValueError("units_of counts FLOP on the meta device: build the UNet under torch.device('meta')")
    order: list[nn.Module] = []
    hooks = [module.register_forward_pre_hook(lambda module, _args: order.append(module) if module not in order else None) for module in modules]
    config, side = unet.config, resolution // 8
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    with torch.device("meta"), FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        unet(torch.zeros(1, config.in_channels, side, side), torch.zeros(1, dtype=torch.long), encoder_hidden_states=torch.zeros(1, 77, config.cross_attention_dim),
             added_cond_kwargs={"text_embeds": torch.zeros(1, pooled), "time_ids": torch.zeros(1, 6)})
    for hook in hooks:
        hook.remove()
    counts = counter.get_flop_counts()  # by module, each module's count including its submodules'

    def path(module: nn.Module) -> str:
        return type(unet).__name__ + (f".{names[module]}" if module is not unet else "")

    def inside(inner: nn.Module, outer: nn.Module) -> bool:
        return inner is not outer and (outer is unet or path(inner).startswith(path(outer) + "."))

    units = []
    for module in order:
        nested = [other for other in modules if inside(other, module)]
        direct = [other for other in nested if not any(inside(other, between) for between in nested)]
        flop = sum(counts.get(path(module), {}).values()) - sum(sum(counts.get(path(other), {}).values()) for other in direct)
        shapes = tuple(tuple(parameter.shape) for parameter in module.parameters() if owner[id(parameter)] is module)
        units.append(Unit(names[module] or "root", shapes, float(flop)))
    return units


@functools.cache
def sdxl_units(resolution: int) -> tuple[Unit, ...]:
    from sdxl_trainer.models.sdxl import build_full_size_unet

    with torch.device("meta"):
        unet = build_full_size_unet()
    return tuple(units_of(unet, resolution))


# ---- what the collectives move --------------------------------------------------------------------------


def collective_bytes(units: list[Unit] | tuple[Unit, ...], settings: SpeedSettings) -> dict[str, int]:
    """Bytes of the tensors FSDP2's collectives move in one update on one rank, by kind, as torch counts a
    collective's size: an all-gather's gathered output, a reduce-scatter's whole input, an all-reduce's tensor
    (what CollectiveBytes counts). Nothing with one process and no offload: the UNet is not sharded there."""
    if settings.gpus == 1:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    shards = settings.shard_group
    reductions = settings.gradient_accumulation_steps if settings.reduce_every_microbatch else 1
    gathered = sum(unit.padded_values(shards) for unit in units) * shards
    if settings.reshard_after_forward:  # every unit for forward and again for backward in each microbatch, but the root (shard_unet)
        root = sum(unit.padded_values(shards) for unit in units if unit.name == "root") * shards
        gathered_per_update = (2 * gathered - root) * settings.gradient_accumulation_steps
    else:  # kept gathered from forward to backward and between microbatches (TrainStep's gather_once_per_update)
        gathered_per_update = gathered
    return {
        "all_gather": gathered_per_update * settings.compute_bytes,
        "reduce_scatter": gathered * settings.reduce_bytes * reductions,
        "all_reduce": (sum(unit.padded_values(shards) for unit in units) * settings.reduce_bytes * reductions) if settings.replicate_groups > 1 else 0,
    }


# ---- time ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeTimes:
    """One GPU's time for a microbatch of the whole UNet, and its host floor, in seconds."""

    seconds: float
    host_floor: float
    source: str


@functools.cache
def _h200_trainer_rows() -> tuple[dict, ...]:
    """The H200 battery's measured trainer steps (its sweep's rows that ran)."""
    rows = json.loads(H200_MEASUREMENT.read_text())["sweep"]["rows"]
    return tuple(row for row in rows if row["path"] == "trainer" and row["seconds_per_step"])


def microbatch_compute(settings: SpeedSettings, flop_per_image: float) -> ComputeTimes:
    """A microbatch's forward and backward on one GPU of the kind, from the H200's measured steps (see the
    module docstring): the effective FLOP/s of its batch-8 step, scaled by peak; at least its batch-1 time."""
    rows = [row for row in _h200_trainer_rows() if row["gradient_checkpointing"] == settings.gradient_checkpointing]
    by_batch = {row["batch_size"]: row["seconds_per_step"] - row["optimizer_seconds"] for row in rows}
    largest = max(by_batch)
    h200_flop_per_image = flop_per_image * (1024 / settings.resolution) ** 2  # the measurement's resolution
    effective = largest * h200_flop_per_image / by_batch[largest] * GPUS[settings.gpu].peak_bf16_flops / H200_PEAK_BF16
    return ComputeTimes(settings.train_batch_size * flop_per_image / effective, by_batch[min(by_batch)],
                        f"{H200_MEASUREMENT.name}: the H200 trainer step at batch {largest} less its optimizer ({by_batch[largest] * 1000:.0f} ms), "
                        f"scaled by peak bf16 FLOP/s to the {settings.gpu}; host floor its batch-1 time ({by_batch[min(by_batch)] * 1000:.0f} ms)")


# Bytes each optimizer's step reads and writes per value of the rank's shard, with fp32 weights and gradients: the
# weights read and written (8) and the gradient read (4), and its state read and written. Adafactor and CAME:
# FACTORED_STEP_WORK.
STEP_BYTES = {
    "adamw8bit": 16,  # two 1-byte moments (their scales, one fp32 per 256 values, left out)
    "adamw": 28,  # two fp32 moments
    "lion": 20,  # one fp32 momentum
    "prodigy": 52,  # first pass: three fp32 moments and p0 read (36); second: the weights and two moments again (16)
    "adamw_schedulefree": 28,  # z and the second moment, fp32
}


@dataclass(frozen=True)
class StepWork:
    """What an eager optimizer step does per run of same-shaped tensors of a kind (shards.StackedRun): operators
    dispatched (each launches a kernel on a GPU), and bytes its operators read and write per value of the run."""

    ops: int
    bytes_per_value: float


@dataclass(frozen=True)
class FactoredStepWork:
    """Adafactor's or CAME's step (optimizers/adafactor.py, came.py): its work per run of factored (2 or more
    dims) and of unfactored tensors, and the operators each update adds once."""

    factored: StepWork
    unfactored: StepWork
    ops_per_update: int


# Keyed by the optimizer and whether the rank's tensors are shards (FSDP2 over 2 or more ranks: each run's update
# is worked out twice, for its RMS over every shard and then to be applied) or whole (once). Counted on the CPU,
# fp32 weights (tests/estimates/test_speed_estimate.py recounts them, the shards' on 2 processes).
FACTORED_STEP_WORK = {
    ("adafactor", False): FactoredStepWork(StepWork(31, 132), StepWork(20, 156), 14),
    ("adafactor", True): FactoredStepWork(StepWork(34, 156), StepWork(22, 176), 15),
    ("came", False): FactoredStepWork(StepWork(55, 240), StepWork(25, 212), 17),
    ("came", True): FactoredStepWork(StepWork(58, 265), StepWork(27, 232), 18),
}
FACTORED_OPTIMIZERS = {"adafactor": "Adafactor", "came": "CAME"}


def factored_step_runs(shapes: list[tuple[int, ...]], shards: int) -> list[tuple[str, int]]:
    """The runs a factored optimizer steps (shards.stacked_runs) over one rank's shards of parameters of these
    `shapes` (dim 0 split over `shards` ranks): each one's kind and values."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for shape in shapes:
        rows = -(-shape[0] // shards) if shape else 1
        by_shape.setdefault(tuple(shape), []).append(rows * math.prod(shape[1:]))
    return [("factored" if len(shape) >= 2 else "unfactored", sum(run))
            for shape, sizes in by_shape.items() for run in runs_of_at_most(sizes, sizes, FACTORED_RUN_VALUES)]


@functools.cache
def host_seconds_per_kernel() -> float:
    """The H200 trainer's batch-1 update with checkpointing (host-bound: batch 4 takes as long) over the
    kernels its profile counted in an update (batch 4; the count does not depend on the batch)."""
    update = min(row["seconds_per_step"] for row in _h200_trainer_rows() if row["gradient_checkpointing"] and row["batch_size"] == 1)
    return update / json.loads(H200_PROFILES.read_text())["trainer_batch4_ckpton"]["kernels_per_step"]


def optimizer_seconds(settings: SpeedSettings, shapes: list[tuple[int, ...]]) -> float:
    """The optimizer step over a rank's shards of parameters of these `shapes`: its memory traffic at 70% of
    the GPU's bandwidth, or its host time, whichever is longer. Adafactor and CAME: their work per run of
    same-shaped tensors (FACTORED_STEP_WORK), their kernels at host_seconds_per_kernel. The others: STEP_BYTES
    a value, the host time the H200 measured for the 8-bit AdamW step (the least of its rows)."""
    bandwidth = GPUS[settings.gpu].memory_bandwidth * 0.7
    if settings.optimizer not in FACTORED_OPTIMIZERS:
        values = sum(math.prod(shape) for shape in shapes)
        host = min(row["optimizer_seconds"] for row in _h200_trainer_rows() if row["optimizer_seconds"])
        return max(STEP_BYTES[settings.optimizer] * values / settings.shard_group / bandwidth, host)
    work = FACTORED_STEP_WORK[(settings.optimizer, settings.shard_group > 1)]
    runs = factored_step_runs(shapes, settings.shard_group)
    traffic = sum(getattr(work, kind).bytes_per_value * values for kind, values in runs)
    kernels = work.ops_per_update + sum(getattr(work, kind).ops for kind, _ in runs)
    return max(traffic / bandwidth, kernels * host_seconds_per_kernel())


@dataclass
class SpeedEstimate:
    settings: SpeedSettings
    update_seconds: float
    compute_seconds: float  # every microbatch's forward and backward, the GPU busy
    optimizer_seconds: float
    exposed_communication_seconds: float  # the compute stream waiting for a collective
    communication_seconds: float  # the link busy, hidden or not
    collective_bytes: dict[str, int]
    compute_source: str

    @property
    def images_per_update(self) -> int:
        settings = self.settings
        return settings.train_batch_size * settings.gradient_accumulation_steps * settings.gpus

    @property
    def images_per_second(self) -> float:
        return self.images_per_update / self.update_seconds

    def report(self) -> str:
        settings = self.settings
        link = LINKS[settings.interconnect]
        lines = [
            f"Speed estimate: {settings.gpus} x {settings.gpu}"
            + (f" in {settings.replicate_groups} machines (HSDP; {GPUS[settings.gpu].intra_node_link} inside, {settings.interconnect} between)"
               if settings.replicate_groups > 1 else f" over {settings.interconnect}" if settings.gpus > 1 else "")
            + f", batch {settings.train_batch_size} x {settings.gpus} GPU x {settings.gradient_accumulation_steps} accumulation "
            f"= {self.images_per_update} images per update at {settings.resolution} px:",
            f"  {self.update_seconds * 1000:.0f} ms per update: compute {self.compute_seconds * 1000:.0f} ms, optimizer "
            f"{self.optimizer_seconds * 1000:.0f} ms"
            + (f", communication not hidden {self.exposed_communication_seconds * 1000:.0f} ms ({self.exposed_communication_seconds / self.update_seconds:.0%} "
               f"of the update; the link is busy {self.communication_seconds * 1000:.0f} ms)" if settings.gpus > 1 else ""),
            f"  {self.images_per_second / settings.gpus:.2f} img/s per GPU, {self.images_per_second:.2f} img/s for the job",
        ]
        moved = {kind: size / 2**30 for kind, size in self.collective_bytes.items()}
        if settings.gpus > 1:
            lines.append(f"  per update and GPU: all-gathers {moved['all_gather']:.1f} GiB, reduce-scatters {moved['reduce_scatter']:.1f} GiB"
                         + (f", all-reduces {moved['all_reduce']:.1f} GiB" if moved["all_reduce"] else ""))
        share = self.exposed_communication_seconds / self.update_seconds
        if settings.gpus > 1 and share > 0.15:
            advice = ["a larger --train_batch_size (more compute to hide each gather behind)"]
            if settings.reshard_after_forward:
                advice.append("--no-reshard_after_forward (each unit gathered once per update instead of twice per microbatch, if the memory allows)")
            if settings.reduce_every_microbatch and settings.gradient_accumulation_steps > 1:
                advice.append("--gradient_reduction once_per_update (one reduce-scatter per update, if the memory allows)")
            if settings.replicate_groups == 1 and settings.gpus > 8:
                advice.append("--replicate_groups MACHINES (gathers inside each machine, only the all-reduce between them)")
            advice.append(f"a faster link than {settings.interconnect} ({link.bandwidth / 1e9:.0f} GB/s assumed)")
            lines.append(f"  {share:.0%} of the update waits for the link: try " + "; ".join(advice) + ".")
        lines.append(f"  compute from {self.compute_source} (per unit: by FLOP; a placeholder until the GPU battery measures units)"
                     + (f"; link {settings.interconnect}: {link.source}" if settings.gpus > 1 else ""))
        if settings.optimizer in FACTORED_OPTIMIZERS:
            name = FACTORED_OPTIMIZERS[settings.optimizer]
            lines.append(f"  optimizer: {name}'s step by its operators counted per run of same-shaped tensors, at the host time per kernel of "
                         f"{H200_PROFILES.name}'s update (likely an upper bound: that update's Python is heavier; {name} has not run on a GPU)")
        return "\n".join(lines)


def estimate_speed(settings: SpeedSettings, units: list[Unit] | tuple[Unit, ...] | None = None) -> SpeedEstimate:
    """The update's time by the model in the module docstring."""
    units = units if units is not None else sdxl_units(settings.resolution)
    flop_per_image = sum(unit.forward_flop for unit in units)
    compute = microbatch_compute(settings, flop_per_image * (4 if settings.gradient_checkpointing else 3))
    microbatch = max(compute.seconds, compute.host_floor)
    forward_share = 1 / (4 if settings.gradient_checkpointing else 3)  # backward: twice the forward, and the recompute
    shares = [unit.forward_flop / flop_per_image for unit in units]
    forward = [microbatch * forward_share * share for share in shares]
    backward = [microbatch * (1 - forward_share) * share for share in shares]
    sharded = settings.gpus > 1
    shards = settings.shard_group
    intra = LINKS[GPUS[settings.gpu].intra_node_link if settings.replicate_groups > 1 else settings.interconnect]
    gather = [(shards - 1) / shards * unit.padded_values(shards) * shards * settings.compute_bytes / intra.bandwidth if sharded else 0.0 for unit in units]
    scatter = [(shards - 1) / shards * unit.padded_values(shards) * shards * settings.reduce_bytes / intra.bandwidth if sharded else 0.0 for unit in units]
    replicas = settings.replicate_groups
    reduce_across = [2 * (replicas - 1) / replicas * unit.padded_values(shards) * settings.reduce_bytes / LINKS[settings.interconnect].bandwidth for unit in units]
    clock = _Timeline()
    none = [0.0] * len(units)
    # Gathered again for backward: every unit under FULL_SHARD but the root, which stays gathered (shard_unet).
    gather_for_backward = [0.0 if unit.name == "root" else seconds for unit, seconds in zip(units, gather)] if settings.reshard_after_forward else none
    for microbatch_number in range(settings.gradient_accumulation_steps):
        reduce_now = settings.reduce_every_microbatch or microbatch_number == settings.gradient_accumulation_steps - 1
        gathered_already = microbatch_number > 0 and not settings.reshard_after_forward  # kept between microbatches
        clock.forward(forward, none if gathered_already else gather)
        clock.backward(backward, gather_for_backward, scatter if reduce_now else none, reduce_across if reduce_now and replicas > 1 else none)
    optimizer = optimizer_seconds(settings, [shape for unit in units for shape in unit.shapes])
    compute_total = sum(forward + backward) * settings.gradient_accumulation_steps
    steps = clock.finish()
    return SpeedEstimate(settings, steps + optimizer, compute_total, optimizer, max(steps - compute_total, 0.0), clock.link_busy,
                         collective_bytes(units, settings), compute.source)


class _Timeline:
    """Two streams, as FSDP2 runs them: the GPU's compute and the link's collectives (each in issue order)."""

    def __init__(self) -> None:
        self.compute_free = 0.0
        self.link_free = 0.0
        self.across_free = 0.0  # HSDP's link between machines
        self.link_busy = 0.0

    def _collective(self, seconds: float, not_before: float) -> float:
        start = max(self.link_free, not_before)
        self.link_free = start + seconds
        self.link_busy += seconds
        return self.link_free

    def forward(self, compute: list[float], gather: list[float]) -> None:
        ready = self._collective(gather[0], self.compute_free)
        for index, seconds in enumerate(compute):
            start = max(self.compute_free, ready)
            if index + 1 < len(compute):  # the next unit's gather, issued once this one computes
                ready = self._collective(gather[index + 1], start)
            self.compute_free = start + seconds

    def backward(self, compute: list[float], gather: list[float], scatter: list[float], reduce_across: list[float]) -> None:
        order = list(reversed(range(len(compute))))
        ready = self._collective(gather[order[0]], self.compute_free)
        for position, index in enumerate(order):
            start = max(self.compute_free, ready)
            if position + 1 < len(order):
                ready = self._collective(gather[order[position + 1]], start)
            self.compute_free = start + compute[index]
            scattered = self._collective(scatter[index], self.compute_free)
            if reduce_across[index]:
                self.across_free = max(self.across_free, scattered) + reduce_across[index]
                self.link_busy += reduce_across[index]

    def finish(self) -> float:
        return max(self.compute_free, self.link_free, self.across_free)


def print_speed_estimate(settings: SpeedSettings) -> None:
    estimate = estimate_speed(settings)
    print(estimate.report())
    if settings.gpus > 1:
        alone = estimate_speed(SpeedSettings(**{**settings.__dict__, "gpus": 1, "replicate_groups": 1}))
        gain = estimate.images_per_second / alone.images_per_second
        print(f"  against one {settings.gpu} with the same settings ({alone.images_per_second:.2f} img/s; whether it fits: --estimate_memory): "
              f"x{gain:.2f} with {settings.gpus} ({gain / settings.gpus:.0%} of a perfect scaling)")

