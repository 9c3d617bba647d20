"""The learning rate as a pure function of the optimizer update number.

A resume needs nothing but the number of updates done: the rate of update n is computed from this
run's settings, never from a rate stored in the optimizer (a scheduler object that multiplies the rate
it finds in place would apply the factor at the save point twice after a resume, and would ignore a
--learning_rate changed on resume). The formulas are those of diffusers.optimization, so a run here
matches the schedules users know from the diffusers scripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from sdxl_trainer.config import option

ScheduleName = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)

@dataclass(kw_only=True)
class ScheduleOptions:
    """Learning-rate schedule"""

    learning_rate_scheduler: ScheduleName = option("constant_with_warmup", help="learning-rate schedule over optimizer updates")
    percent_lr_warm_up_steps: float = option(0.05, help="share (0-1) of all optimizer updates spent warming up linearly from 0")
    lr_num_cycles: int = option(1, help="hard restarts for cosine_with_restarts")
    polynomial_lr_end: float = option(1e-7, help="final learning rate of the polynomial schedule")
    polynomial_power: float = option(1.0, help="power of the polynomial schedule (1 = linear decay)")

    def problems(self) -> list[str]:
        problems = []
        if not 0 <= self.percent_lr_warm_up_steps <= 1:
            problems.append(f"--percent_lr_warm_up_steps is a share between 0 and 1 (0.1 = 10%), got {self.percent_lr_warm_up_steps}")
        if not self.polynomial_power > 0:
            problems.append(f"--polynomial_power must be > 0, got {self.polynomial_power}")
        if self.polynomial_lr_end < 0:
            problems.append(f"--polynomial_lr_end must be >= 0, got {self.polynomial_lr_end}")
        if self.lr_num_cycles < 1:
            problems.append(f"--lr_num_cycles must be at least 1, got {self.lr_num_cycles}")
        return problems


@dataclass(frozen=True)
class LearningRateSchedule:
    name: ScheduleName
    peak: float  # the rate after warm-up (the start of the decay)
    warmup_updates: int  # updates 0 .. warmup_updates-1 rise linearly from 0
    total_updates: int  # the decay reaches its end here
    num_cycles: int = 1  # hard restarts of cosine_with_restarts
    polynomial_end: float = 1e-7  # final rate of the polynomial schedule
    polynomial_power: float = 1.0

    def __call__(self, update: int) -> float:
        """The rate of optimizer update `update` (counted from 0)."""
        return self.peak * self.factor(update)

    def factor(self, update: int) -> float:
        if self.name == "constant":
            return 1.0
        if update < self.warmup_updates:
            return update / max(1, self.warmup_updates)
        if self.name == "constant_with_warmup":
            return 1.0
        decay_updates = max(1, self.total_updates - self.warmup_updates)
        progress = (update - self.warmup_updates) / decay_updates
        if self.name == "linear":
            return max(0.0, (self.total_updates - update) / decay_updates)
        if self.name == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # half a cosine, as diffusers' default
        if self.name == "cosine_with_restarts":
            if progress >= 1.0:
                return 0.0
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((self.num_cycles * progress) % 1.0))))
        if self.name == "polynomial":
            if update > self.total_updates:
                return self.polynomial_end / self.peak
            remaining = 1 - (update - self.warmup_updates) / decay_updates
            return ((self.peak - self.polynomial_end) * remaining**self.polynomial_power + self.polynomial_end) / self.peak
        raise ValueError(f"unknown learning-rate schedule {self.name!r}; choose from {SCHEDULE_NAMES}")


LR_SCALE = "lr_scale"  # a param group's rate relative to the schedule's (--learning_rate_te1 / --learning_rate)


def set_learning_rate(optimizer: torch.optim.Optimizer, rate: float) -> None:
    """Every param group at `rate` times its LR_SCALE (1 if it has none): the text encoders' groups follow
    the same schedule from their own peak rates."""
    for group in optimizer.param_groups:
        group_rate = rate * group.get(LR_SCALE, 1.0)
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor so its compiled step never recompiles
            group["lr"].fill_(group_rate)
        else:
            group["lr"] = group_rate
