"""The one comparison of the trainer against a plain loop (steps.py's two paths), per configuration: each
path built, warmed up, timed, its optimizer step timed alone, optionally profiled, then freed; and the table
train_throughput.py prints.

By default the paths run one after the other and each model is freed before the next is built: two full-size
UNets with fp32 weights, gradients and 8-bit AdamW states do not fit one GPU beside their activations, and a
dedicated GPU's step time is steady after warm-up. With rounds > 1 both paths are built at once and their
measured windows alternate, so that a shared machine's noise (a CPU that other jobs use) hits them alike;
each path's peak memory then cannot be told apart and reads n/a.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.lib.flops import NOMINAL_TFLOP_1024, flop_per_image, matmul_side
from benchmarks.lib.profiling import PROFILED_STEPS, profile_steps
from benchmarks.lib.results import device_name
from benchmarks.lib.steps import BuiltPath, StepSettings, build_plain_loop, build_trainer
from benchmarks.lib.synthetic_cache import write_cache_for_unet
from benchmarks.lib.timing import OPTIMIZER_TIMED_STEPS, StepTimes, optimizer_seconds, time_rounds, warm_up
from sdxl_trainer.distributed.world import World, init_distributed, shutdown_distributed
from sdxl_trainer.jobs.train_config import resolve_compute_dtype
from sdxl_trainer.monitoring.memory_peaks import gather_floats, peak_memory_gib

ATTENTION_BACKENDS = {
    "sdpa": None,  # PyTorch picks the kernel
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
GPU_ONLY_ATTENTION = ("efficient", "cudnn")
REFERENCES = {
    "plain": "reference = plain nn.Module (under torch.autocast unless fp32), same batch, optimizer and checkpointing",
    "fsdp2": "reference = hand-written loop over the same FSDP2-sharded model, same batch, optimizer and checkpointing",
    "none": "no reference loop",
}
COLUMNS = (
    "batch", "checkpointing", "path", "images/s per GPU", "ms per step", "optimizer ms", "MFU %", "peak allocated GiB",
    "peak reserved GiB", "step time / reference",
)


@dataclass(frozen=True)
class Measurement:
    """How each configuration's paths are run and timed."""

    warmup_steps: int = 3  # untimed updates before the measured windows (compiles, allocator)
    measured_steps: int = 10  # updates per measured window
    rounds: int = 1  # measured windows per path; 1 = the paths one after the other, each freed before the next is built
    attention: str = "sdpa"  # ATTENTION_BACKENDS' key: the SDPA kernel every update of both paths is restricted to
    read_data: bool = False  # the trainer path reads and logs each update as the trainer does (steps.py), from a synthetic cache
    profile_dir: Path | None = None  # where PROFILED_STEPS more updates of each path are profiled to; None = no profile

    def updates_per_path(self) -> int:
        return self.warmup_steps + self.rounds * self.measured_steps + OPTIMIZER_TIMED_STEPS + (PROFILED_STEPS if self.profile_dir else 0)


@dataclass
class PathResult:
    settings: StepSettings
    path: str
    seconds_per_step: float | None  # None: ran out of GPU memory
    first_step_seconds: float | None  # the first warm-up step alone: compilation and the allocator's first requests
    optimizer_seconds: float | None  # of optimizer.step alone; None: out of memory, or every step skipped (fp16 overflow)
    peak_allocated_gib: float | None  # None: not measured (CPU, or paths built together)
    peak_reserved_gib: float | None
    cpu_seconds_per_step: float | None = None  # the process's CPU time per measured step (timing.StepTimes)
    minor_faults_per_step: float | None = None
    data_wait_share: float | None = None  # of the measured updates' time, spent waiting for the data (read_data's trainer path only)

    def figures(self, peak_flops: float) -> dict:
        """Every field, the settings' batch and checkpointing first, and images/s and MFU when measured: a JSON row."""
        row = {"batch_size": self.settings.batch_size, "gradient_checkpointing": self.settings.gradient_checkpointing}
        row.update({field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "settings"})
        if self.seconds_per_step is not None:
            images_per_second = self.settings.batch_size / self.seconds_per_step
            flop = flop_per_image(self.settings.model, self.settings.resolution, self.settings.gradient_checkpointing)
            row.update(images_per_second=images_per_second, mfu=images_per_second * flop / peak_flops)
        return row


def resolve_reference(reference: str, settings: StepSettings, world_size: int) -> str:
    """auto: the plain loop on one process, the FSDP2 loop on several; none where no plain loop is a peer
    (bf16 weights need the trainer's stochastic rounding, offloaded ones its CPU step)."""
    if reference != "auto":
        return reference
    if settings.weights_dtype != "fp32" or settings.cpu_offload:
        return "none"
    return "plain" if world_size == 1 else "fsdp2"


def use_trainer_matmul_precision(device: torch.device) -> None:
    """As the trainer's --allow_tf32 default: TF32 for whatever fp32 matmuls and convolutions remain on a GPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"


def compare(rows: list[StepSettings], reference: str, measurement: Measurement, world: World) -> list[PathResult]:
    """The reference path (unless "none") and the trainer's, for each configuration in `rows`. Collective."""
    results = []
    backend = ATTENTION_BACKENDS[measurement.attention]
    attention = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    scratch_folder = _shared_scratch(world) if measurement.read_data else contextlib.nullcontext()
    with scratch_folder as scratch, attention:
        for row_index, settings in enumerate(rows):
            cache_dir = None
            if measurement.read_data:
                cache_dir = scratch / f"row{row_index}" / "cache"
                if world.is_main:
                    items = measurement.updates_per_path() * settings.batch_size * world.world_size
                    write_cache_for_unet(cache_dir, settings.model, settings.resolution, items)
                dist.barrier()
            builders = {}
            if reference != "none":
                builders[f"reference ({reference})"] = functools.partial(build_plain_loop, settings, world, sharded=reference == "fsdp2")
            builders["trainer"] = functools.partial(build_trainer, settings, world, cache_dir)
            groups = [builders] if measurement.rounds > 1 else [{name: build} for name, build in builders.items()]
            for group in groups:
                results += _measure_together(group, settings, measurement, world)
    return results


@contextlib.contextmanager
def _shared_scratch(world: World) -> Iterator[Path]:
    """A temporary folder every rank of this machine sees (made by rank 0, its name broadcast), removed at the end."""
    name = [tempfile.mkdtemp(prefix="benchmark_") if world.is_main else None]
    dist.broadcast_object_list(name, src=0)
    try:
        yield Path(name[0])
    finally:
        dist.barrier()
        if world.is_main:
            shutil.rmtree(name[0], ignore_errors=True)


def _measure_together(builders: dict[str, Callable[[], BuiltPath]], settings: StepSettings, measurement: Measurement, world: World) -> list[PathResult]:
    """Build the paths, time them (their windows alternating when there are several), free them; a CUDA
    out-of-memory error makes every one of them read OOM."""
    if settings.compile:
        torch._dynamo.reset()  # each path compiles its own graphs, within the recompile limit
    on_gpu = world.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(world.device)
    built: dict[str, BuiltPath] = {}
    times: dict[str, StepTimes] = {}
    optimizer: dict[str, float | None] = {}
    data_wait: dict[str, float | None] = {}
    try:
        built = {name: build() for name, build in builders.items()}
        steps = {name: path.step for name, path in built.items()}
        first_seconds = warm_up(steps, measurement.warmup_steps, world)
        before = {name: (path.throughput.data_seconds, path.throughput.seconds) for name, path in built.items() if path.throughput}
        times = time_rounds(steps, measurement.warmup_steps, measurement.measured_steps, measurement.rounds, world, first_seconds)
        for name, (data_seconds, seconds) in before.items():
            throughput = built[name].throughput
            data_wait[name] = (throughput.data_seconds - data_seconds) / (throughput.seconds - seconds)  # over the measured windows only
        after_windows = measurement.warmup_steps + measurement.rounds * measurement.measured_steps
        optimizer = {name: optimizer_seconds(step, after_windows, world) for name, step in steps.items()}
        if measurement.profile_dir:
            for name, step in steps.items():
                profile_steps(step, after_windows + OPTIMIZER_TIMED_STEPS, _profile_label(name, settings), measurement.profile_dir, world)
    except torch.OutOfMemoryError:
        times = {}  # the rows read OOM; the models are freed below, once the handler has dropped the traceback
    finally:
        for path in built.values():
            path.close()
    built.clear()
    gc.collect()
    allocated = reserved = None
    if on_gpu:
        if len(builders) == 1:
            allocated = max(gather_floats(peak_memory_gib(world.device), world.device))
            reserved = max(gather_floats(torch.cuda.max_memory_reserved(world.device) / 2**30, world.device))
        torch.cuda.empty_cache()
    results = []
    for name in builders:
        measured = times.get(name)
        result = PathResult(settings, name, None, None, None, allocated, reserved)
        if measured is not None:
            result = dataclasses.replace(
                result, seconds_per_step=measured.seconds_per_step, first_step_seconds=measured.first_step_seconds, optimizer_seconds=optimizer[name],
                cpu_seconds_per_step=measured.cpu_seconds_per_step, minor_faults_per_step=measured.minor_faults_per_step, data_wait_share=data_wait.get(name),
            )  # fmt: skip
        if world.is_main:
            speed = "OOM" if measured is None else f"{settings.batch_size / measured.seconds_per_step:.3f} images/s"
            print(f"  batch {settings.batch_size}, checkpointing {on_off(settings.gradient_checkpointing)}, {name}: {speed}", flush=True)
        results.append(result)
    return results


def _profile_label(name: str, settings: StepSettings) -> str:
    compiled = "_compiled" if settings.compile else ""
    return f"{name.split()[0]}_batch{settings.batch_size}_ckpt{on_off(settings.gradient_checkpointing)}{compiled}"


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _number(value: float | None, spec: str, missing: str) -> str:
    return missing if value is None else format(value, spec)


def table(results: list[PathResult], peak_flops: float) -> str:
    """The Markdown table of COLUMNS, one line per path and configuration; a path that ran out of memory reads OOM."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    references = {result.settings: result for result in results if result.path.startswith("reference")}
    for result in results:
        settings, seconds = result.settings, result.seconds_per_step
        oom = seconds is None
        images_per_second = None if oom else settings.batch_size / seconds
        flop = flop_per_image(settings.model, settings.resolution, settings.gradient_checkpointing)
        mfu = None if oom else images_per_second * flop / peak_flops * 100
        reference = references.get(settings)
        ratio = None
        if not oom and reference is not None and reference.seconds_per_step is not None:
            ratio = seconds / reference.seconds_per_step
        cells = [
            str(settings.batch_size),
            on_off(settings.gradient_checkpointing),
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


def summary(rows: list[StepSettings], reference: str, measurement: Measurement, peak_flops: float, world: World) -> str:
    """The lines above the table: what was trained, on what, how it was timed, and the FLOP and peak figures."""
    settings = rows[0]
    dtype = str(settings.compute_dtype).removeprefix("torch.")
    latent = settings.resolution // 8
    checkpointing = sorted({row.gradient_checkpointing for row in rows})
    counted = {flag: flop_per_image(settings.model, settings.resolution, flag) / 1e12 for flag in checkpointing}
    counted_text = ", ".join(f"{value:.4g} with checkpointing {on_off(flag)}" for flag, value in counted.items())
    nominal = ""
    if settings.model == "sdxl" and settings.resolution == 1024:
        nominal = f" (issue 7's nominal: {NOMINAL_TFLOP_1024[False]} off, {NOMINAL_TFLOP_1024[True]} on)"
    windows = f"{measurement.rounds} alternating rounds of {measurement.measured_steps}" if measurement.rounds > 1 else f"{measurement.measured_steps}"
    data = "; the trainer reads and logs each update as sdxl_FSDP_train.py does (a synthetic cache)" if measurement.read_data else ""
    side = matmul_side(world.device)
    return "\n".join(
        [
            f"- model: {settings.model} UNet, random weights; {settings.resolution} x {settings.resolution} px (latents 4 x {latent} x {latent})",
            f"- {world.world_size} process(es) on {device_name(world.device)}; compute {dtype}; optimizer {settings.optimizer}; "
            f"weights {settings.weights_dtype}{'; CPU offload' if settings.cpu_offload else ''}; compile {on_off(settings.compile)}; "
            f"attention {measurement.attention}; {measurement.warmup_steps} warm-up + {windows} measured steps per path{data}",
            f"- trainer = TrainStep over the UNet as the trainer prepares it ({'FSDP2' if world.world_size > 1 else 'plain, autocast'}); "
            f"{REFERENCES[reference]}",
            f"- TFLOP per image, counted (forward + backward, recompute included): {counted_text}{nominal}",
            f"- peak: {peak_flops / 1e12:.4g} TFLOP/s, a {side}^3 {dtype} matmul timed on this device; MFU = images/s x FLOP per image / peak",
        ]
    )


def trainer_ms_per_step(settings: StepSettings, mixed_precision: str, measurement: Measurement) -> float | None:
    """The trainer path's ms per step alone, as train_throughput.py --reference none measures it, in a
    one-process group of its own (run it in a fresh process: processes.call_in_fresh_process); None if it
    ran out of memory. `mixed_precision`: the trainer's flag, resolved on this process's device."""
    world = init_distributed()
    try:
        use_trainer_matmul_precision(world.device)
        settings = dataclasses.replace(settings, compute_dtype=resolve_compute_dtype(mixed_precision, world.device, settings.weights_dtype))
        (result,) = compare([settings], "none", measurement, world)
    finally:
        shutdown_distributed()
    return None if result.seconds_per_step is None else 1000 * result.seconds_per_step
