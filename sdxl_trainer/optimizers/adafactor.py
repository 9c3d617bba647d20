"""Adafactor (factored second moments, no momentum) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, _Entry, _sum_over_shards, factored_zeros, fp32_zeros_like, host_values_to, scaled_by_factors,
    start_factored_step,
)
from sdxl_trainer.optimizers.stochastic_rounding import rounding_keys, store_weights
from sdxl_trainer.distributed.local_shard import local_shard


class Adafactor(StepsIfFinite, torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with an explicit learning rate, no first moment and update clipping:
    the settings kohya sd-scripts users pass to transformers' Adafactor (relative_step=False,
    scale_parameter=False, warmup_init=False). Second moments of a weight with 2 or more dims are factored
    over (dim 0, all other dims flattened), so a conv kernel keeps one row and one column statistic
    (transformers factors its last two dims, a 3x3 kernel's). A 2-dim and a 1-dim weight get transformers'
    update to fp32 rounding (tests/optimizers/test_optimizers.py).

    It steps each rank's local shards. FSDP2 splits dim 0, so the row statistics and the elementwise ops are
    local; what needs every row (the column means, the mean of the row statistics, the update's RMS) is
    summed over the shards for all parameters of a group at once: two all-reduces per update, where DTensor
    ops made three per factored weight and one per other parameter, and a host sync per parameter. Nothing
    is read on the host: the step counts live on the device, and a skipped update (step(finite=...),
    StepsIfFinite) is selected there (its gradients count as zeros, its moments' weight of the new is 0, and
    the weights are kept).
    The update is computed twice, before and after its RMS is known, so no more than one parameter's update
    is held at a time."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        decay_rate: float = -0.8,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, decay_rate=decay_rate, eps=eps, clip_threshold=clip_threshold, weight_decay=weight_decay))

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        state = {"step": torch.zeros((), dtype=torch.float32, device=local_shard(param).device)}
        if param.ndim < 2:
            state["exp_avg_sq"] = fp32_zeros_like(param)
            return state
        state["exp_avg_sq_row"], state["exp_avg_sq_col"] = factored_zeros(param)
        return state

    @staticmethod
    def _update(entry: _Entry, row_mean: torch.Tensor | None) -> torch.Tensor:
        """The unclipped update from the entry's second-moment state (already this step's); `row_mean`: the
        mean of a factored weight's row statistics over all its rows."""
        grad = entry.grad.float()
        if row_mean is None:
            return grad * local_shard(entry.state["exp_avg_sq"]).rsqrt()
        return scaled_by_factors(grad, local_shard(entry.state["exp_avg_sq_row"]), row_mean, local_shard(entry.state["exp_avg_sq_col"]))

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, step counts) where `finite` (a bool scalar on the device) is
        False; None: always."""
        for group, entries in _entries_per_group(self, self._new_state):
            shard_group, verdict, steps = start_factored_step(entries, finite)
            # 1 - beta2 of this step, for each entry; 0 where the update is skipped (the moments stay).
            counts = torch.stack([steps[entry.index] for entry in entries])
            weights_of_new = torch.where(verdict, counts.pow(group["decay_rate"]), 0.0)

            # Rows and unfactored moments are local: update them; sum each factored weight's squared gradient
            # over its columns' local rows, and its new row statistics, then over every shard in one all-reduce.
            sums = []
            for entry, weight_of_new in zip(entries, weights_of_new):
                squared = entry.grad.float().square().add_(group["eps"])
                if "exp_avg_sq" in entry.state:
                    local_shard(entry.state["exp_avg_sq"]).lerp_(squared, weight_of_new)
                    continue
                flat = squared.flatten(1)
                rows = local_shard(entry.state["exp_avg_sq_row"])
                rows.lerp_(flat.mean(1), weight_of_new)
                sums += [flat.sum(0), rows.sum().reshape(1)]
            summed = iter(_sum_over_shards(torch.cat(sums), shard_group).split([part.numel() for part in sums])) if sums else iter(())

            # The column statistics and the mean row statistic from the sums; each update's sum of squares.
            squares, row_means = [], []
            for entry, weight_of_new in zip(entries, weights_of_new):
                row_mean = None
                if "exp_avg_sq_col" in entry.state:
                    row_count = entry.param.shape[0]
                    local_shard(entry.state["exp_avg_sq_col"]).lerp_(next(summed) / row_count, weight_of_new)
                    row_mean = next(summed) / row_count
                row_means.append(row_mean)
                squares.append(self._update(entry, row_mean).square().sum())
            squares = _sum_over_shards(torch.stack(squares), shard_group)
            numels = host_values_to([float(entry.param.numel()) for entry in entries], torch.float32, squares.device)
            clip_divisors = ((squares.sqrt() / numels.sqrt()) / group["clip_threshold"]).clamp(min=1.0)

            keys = None  # bf16 weights: each tensor's key from its step count and number
            if any(entry.weights.dtype == torch.bfloat16 for entry in entries):
                keys = rounding_keys(counts, [entry.index for entry in entries])
            for number, (entry, row_mean, clip_divisor) in enumerate(zip(entries, row_means, clip_divisors)):
                update = self._update(entry, row_mean).div_(clip_divisor).mul_(group["lr"])
                weights = entry.weights.float()
                if group["weight_decay"]:
                    weights = weights * (1 - group["lr"] * group["weight_decay"])
                # A skipped update's moments may still hold zeros (skipped first updates), whose update is not finite.
                store_weights(entry.weights, torch.where(verdict, weights - update, entry.weights.float()), keys, number)
