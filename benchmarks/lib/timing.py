"""How long a step takes: a warm-up, then a measured window timed as a whole (the device synchronized at its
ends only, so the host queues work ahead as it does in training), of the slowest rank; several steps' windows
in alternating rounds; and optimizer.step's own time."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from sdxl_trainer.distributed.world import World
from sdxl_trainer.monitoring.memory_peaks import gather_floats

Step = Callable[[int], object]  # update number -> whatever the update returns
OPTIMIZER_TIMED_STEPS = 3  # after the measured windows: the synchronizations around optimizer.step stay out of them


@dataclass(frozen=True)
class StepTimes:
    seconds_per_step: float  # mean over every measured step, of the slowest rank
    first_step_seconds: float | None  # the first warm-up step alone (compilation, the allocator's first requests); None without warm-up
    cpu_seconds_per_step: float  # the process's CPU time (all its threads) per measured step, of the busiest rank
    minor_faults_per_step: float  # pages faulted in per measured step (heap handed back to the OS and taken again), of the rank with most


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(steps: dict[str, Step], warmup_steps: int, measured_steps: int, rounds: int, world: World) -> dict[str, StepTimes]:
    """warm_up, then time_rounds from the first update after it. Collective."""
    return time_rounds(steps, warmup_steps, measured_steps, rounds, world, warm_up(steps, warmup_steps, world))


def warm_up(steps: dict[str, Step], warmup_steps: int, world: World) -> dict[str, float | None]:
    """Each step's updates 0 .. warmup_steps - 1, one step after the other; the seconds of each one's first
    update, of the slowest rank (None without warm-up). Collective."""
    return {name: _warm_up(step, warmup_steps, world) for name, step in steps.items()}


def time_rounds(steps: dict[str, Step], first_index: int, measured_steps: int, rounds: int, world: World,
                first_step_seconds: dict[str, float | None]) -> dict[str, StepTimes]:
    """`rounds` rounds in which every step runs a window of `measured_steps` updates in turn, so that a shared
    machine's noise hits them alike; each step numbers its updates on from `first_index`. Collective."""
    usage = {name: np.zeros(3) for name in steps}  # wall seconds, CPU seconds, minor faults over the windows
    for round_index in range(rounds):
        first = first_index + round_index * measured_steps
        for name, step in steps.items():
            usage[name] += _window(step, range(first, first + measured_steps), world)
    count = rounds * measured_steps
    times = {}
    for name, (wall, cpu, faults) in usage.items():
        slowest = [max(gather_floats(value, world.device)) / count for value in (wall, cpu, faults)]
        times[name] = StepTimes(slowest[0], first_step_seconds[name], slowest[1], slowest[2])
    return times


def _warm_up(step: Step, warmup_steps: int, world: World) -> float | None:
    """Runs the warm-up; the first step's seconds, of the slowest rank (None without warm-up)."""
    dist.barrier()
    first = None
    for index in range(warmup_steps):
        started = time.perf_counter()
        step(index)
        if index == 0:
            synchronize(world.device)
            first = max(gather_floats(time.perf_counter() - started, world.device))
    return first


def _window(step: Step, indices: range, world: World) -> np.ndarray:
    """(wall seconds, CPU seconds, minor page faults) of this process over the steps `indices`, the ranks
    started together."""
    synchronize(world.device)
    dist.barrier()
    faults, cpu, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    for index in indices:
        step(index)
    synchronize(world.device)
    return np.array([time.perf_counter() - started, time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults])


def optimizer_seconds(step: Step, first_index: int, world: World) -> float | None:
    """Mean seconds of optimizer.step alone (the device synchronized before and after it), of the slowest rank,
    over OPTIMIZER_TIMED_STEPS more steps from update `first_index`; None when no step reached the optimizer
    (fp16: every one skipped on overflow)."""
    durations, started = [], []

    def before(*_) -> None:
        synchronize(world.device)
        started.append(time.perf_counter())

    def after(*_) -> None:
        synchronize(world.device)
        durations.append(time.perf_counter() - started[-1])

    hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        for index in range(first_index, first_index + OPTIMIZER_TIMED_STEPS):
            step(index)
    finally:
        for hook in hooks:
            hook.remove()
    means = gather_floats(sum(durations) / len(durations) if durations else math.nan, world.device)
    return None if any(math.isnan(mean) for mean in means) else max(means)
