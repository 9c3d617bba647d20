"""A few steps under torch.profiler (rank 0's view): the operators that took the most device time (CPU time
on a CPU) as a table, the optimizer step's inclusive time, and where each step's time went (time_split),
added to profiles.json in the same folder."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from benchmarks.lib.timing import Step, synchronize
from sdxl_trainer.distributed.world import World

PROFILED_STEPS = 2
OPTIMIZER_EVENT = "Optimizer.step#"  # torch.optim records every step under this name, on the host and on the GPU


def profile_steps(step: Step, first_index: int, label: str, folder: Path, world: World) -> None:
    """PROFILED_STEPS steps from update `first_index`; writes folder/LABEL.txt and the summary under `label` in
    folder/profiles.json, and prints the summary. Collective (every rank runs the steps)."""
    on_gpu = world.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    synchronize(world.device)
    with torch.profiler.profile(activities=activities) as profiler:
        started = time.perf_counter()
        for index in range(first_index, first_index + PROFILED_STEPS):
            step(index)
        synchronize(world.device)
        wall = time.perf_counter() - started
    if not world.is_main:
        return
    folder.mkdir(parents=True, exist_ok=True)
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    averages = profiler.key_averages()
    # The optimizer step's self time is small (its kernels are its children), so under load its row can fall
    # out of the 40 above: its inclusive time follows on lines of its own.
    optimizer_lines = [
        f"{event.key}: {event.count} calls, {event.cpu_time_total / 1000:.1f} ms of host time in all"
        + (f", {event.device_time_total / 1000:.1f} ms of device time" if on_gpu else "")
        for event in averages if event.key.startswith(OPTIMIZER_EVENT)
    ]
    (folder / f"{label}.txt").write_text(averages.table(sort_by=sort_by, row_limit=40) + "\n" + "\n".join(optimizer_lines) + "\n")
    summaries_path = folder / "profiles.json"
    summaries = json.loads(summaries_path.read_text()) if summaries_path.exists() else {}
    summaries[label] = time_split(profiler.events(), PROFILED_STEPS, wall, on_gpu)
    summaries_path.write_text(json.dumps(summaries, indent=1) + "\n")
    print(f"  profile of {label}: {json.dumps(summaries[label])}", flush=True)


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
