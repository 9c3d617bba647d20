"""Prodigy (Adam with a step size it estimates as it trains) over local shards, the estimate summed over every
parameter of every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, flatten_tensors, fp32_zeros_like, one_tensor_in_every_state, runs_by_kind, sum_over_all_shards,
    unflatten_tensors,
)
from sdxl_trainer.optimizers.stochastic_rounding import rounding_keys, store_run

# Values per chunk: the step's temporaries are a few fp32 copies of the values it updates at once (Lion's size).
CHUNK_VALUES = 1 << 24
# The state key of the scalars every parameter shares (one tensor: state/save.py saves per-parameter state only):
# the step size d, the largest estimate so far, the estimate's running numerator, and the updates taken.
SHARED = "prodigy_d"
D, D_MAX, NUMERATOR, UPDATES = range(4)


@dataclass(frozen=True)
class ProdigySettings:
    """Prodigy's own settings (prodigyopt's names and defaults); betas, eps and weight decay are the run's."""

    d0: float = 1e-6  # the first estimate of d: rarely needs changing
    d_coef: float = 1.0  # scales every estimate of d: the preferred way to tune Prodigy
    growth_rate: float = math.inf  # the most d may grow in one update (a factor); inf = unbounded
    use_bias_correction: bool = False  # Adam's bias correction in the step size
    safeguard_warmup: bool = False  # leave the learning rate out of the estimate's denominator: for warm-up


class Prodigy(StepsIfFinite, torch.optim.Optimizer):
    """Prodigy (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner"): AdamW
    whose step is d x lr, with d estimated from how far the weights have moved from where they started (p0)
    against the gradients seen. The update is prodigyopt's (1.1.2, decoupled weight decay): tested against it.

    d is one number for all parameters, so its sums run over every parameter of every rank: each rank sums over
    its local shards, and one all-reduce per update (over FSDP2's shard groups; nothing with one process) adds
    them up on the device. prodigyopt reads each parameter's sums on the host (a wait per tensor), and on
    FSDP2's DTensors, unless told they are sharded, each rank would estimate a d of its own. Here nothing is read
    on the host: d, its numerator and the update count live on the device, in every parameter's state as one
    shared tensor (SHARED).

    Every other operation is elementwise and runs on flat runs of many local shards (as Lion). Two passes: the
    moments, the running sum s and the estimate's sums; then, once d is known, the weights. A skipped update
    (step(finite=...), StepsIfFinite) leaves weights, moments, s and d as they were; so does an update whose
    estimate has nothing to divide by (every gradient so far zero), where prodigyopt returns early.

    The learning rate multiplies d (1.0 is Prodigy's value). prodigyopt takes one rate for all groups; here
    each group steps at d x its own rate, and its sums count in proportion, which is prodigyopt's update when
    the rates are equal. Betas, eps and the Prodigy settings are the optimizer's, as d is. Over bf16 weights
    the moments and s stay fp32 and p0 is a bf16 copy of the starting weights (exact)."""

    steps_in_parts = (
        "its step size d comes from sums over every parameter's gradient and state, which must all be in before any "
        "weight moves"
    )

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, settings: ProdigySettings = ProdigySettings()):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.betas, self.eps, self.settings = betas, eps, settings
        self.beta3 = math.sqrt(betas[1])  # prodigyopt's default: the running sums' decay

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        local = local_shard(param)
        start = local.detach().clone()
        if isinstance(param, DTensor):
            start = DTensor.from_local(start, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
        return {"exp_avg": fp32_zeros_like(param), "exp_avg_sq": fp32_zeros_like(param), "s": fp32_zeros_like(param), "p0": start}

    def _new_shared(self, device: torch.device) -> torch.Tensor:
        # float64, as prodigyopt keeps them in Python floats: d's numerator sums over every update.
        return torch.tensor([self.settings.d0, self.settings.d0, 0.0, 0.0], dtype=torch.float64, device=device)

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, s, d) where `finite` (a bool scalar on the device) is False;
        None: always. Nothing here reads a value from the device."""
        groups = list(_entries_per_group(self, self._new_state))
        if not groups:
            return
        everything = [entry for _, entries in groups for entry in entries]
        shared = one_tensor_in_every_state([entry.state for entry in everything], SHARED, lambda: self._new_shared(everything[0].weights.device))
        # A group at rate 0 is left as it is; with every rate 0 (a warm-up's first update) nothing moves, as in prodigyopt.
        stepped = [(group, entries) for group, entries in groups if group["lr"] > 0]
        if not stepped:
            return
        settings, (beta1, beta2) = self.settings, self.betas
        device = shared.device
        verdict = torch.ones((), dtype=torch.bool, device=device) if finite is None else finite.to(device)
        d, d_max, numerator, updates = shared.unbind()
        bias_correction = (1 - beta2 ** (updates + 1)).sqrt() / (1 - beta1 ** (updates + 1)) if settings.use_bias_correction else torch.ones_like(d)
        d_scale = d / settings.d0  # prodigyopt's: d / d0 keeps the sums from getting too small
        step_sizes = [d * group["lr"] * bias_correction for group, _ in stepped]  # this update's, from the d it starts with

        # Pass 1: moments and s (kept where the update is skipped), and this rank's sums of lr * <g, p0 - p> and |s|.
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for (group, entries), step_size in zip(stepped, step_sizes):
            s_weight = d_scale * (d if settings.safeguard_warmup else step_size)
            for chunk in runs_by_kind(entries, CHUNK_VALUES):
                grads = flatten_tensors([entry.grad for entry in chunk]).float()
                weights = flatten_tensors([entry.weights for entry in chunk]).float()
                starts = flatten_tensors([local_shard(entry.state["p0"]) for entry in chunk]).float()
                moments = [[local_shard(entry.state[key]) for entry in chunk] for key in ("exp_avg", "exp_avg_sq", "s")]
                exp_avg, exp_avg_sq, s = (flatten_tensors(tensors) for tensors in moments)
                new_exp_avg = exp_avg * beta1 + grads * (d * (1 - beta1))
                new_exp_avg_sq = exp_avg_sq * beta2 + grads * grads * (d * d * (1 - beta2))
                new_s = s * self.beta3 + grads * s_weight
                sums += torch.stack([torch.dot(grads, starts - weights) * group["lr"], new_s.abs().sum()])
                for tensors, old, new in zip(moments, (exp_avg, exp_avg_sq, s), (new_exp_avg, new_exp_avg_sq, new_s)):
                    torch._foreach_copy_(tensors, unflatten_tensors(torch.where(verdict, new, old), tensors))

        # d from the sums over every rank: one all-reduce.
        dot, s_sum = sum_over_all_shards(sums, everything).unbind()
        new_numerator = numerator * self.beta3 + d_scale * d * bias_correction * dot
        estimate = settings.d_coef * new_numerator / s_sum
        steps = verdict & (s_sum > 0)
        new_d = torch.where(d == settings.d0, torch.maximum(d, estimate), d)
        new_d_max = torch.maximum(d_max, estimate)
        new_d = torch.minimum(new_d_max, new_d * settings.growth_rate)
        new_updates = updates + steps.double()

        # Pass 2: the weights, at this update's step size, with the new d's eps.
        for (group, entries), step_size in zip(stepped, step_sizes):
            chunks = list(runs_by_kind(entries, CHUNK_VALUES))
            keys = None  # bf16 weights: each chunk keyed by the update count and its first tensor's number
            if any(chunk[0].weights.dtype == torch.bfloat16 for chunk in chunks):
                keys = rounding_keys(new_updates, [chunk[0].index for chunk in chunks])
            for number, chunk in enumerate(chunks):
                weights = [entry.weights for entry in chunk]
                flat = flatten_tensors(weights).float()
                exp_avg = flatten_tensors([local_shard(entry.state["exp_avg"]) for entry in chunk])
                denominator = flatten_tensors([local_shard(entry.state["exp_avg_sq"]) for entry in chunk]).sqrt() + new_d * self.eps
                new_weights = flat
                if group["weight_decay"]:
                    new_weights = new_weights + new_weights * (-group["weight_decay"] * step_size)
                new_weights = torch.where(steps, new_weights - step_size * exp_avg / denominator, flat)
                store_run(weights, new_weights, keys, number)
        shared.copy_(torch.where(steps, torch.stack([new_d, new_d_max, new_numerator, new_updates]), shared))
