"""Adafactor (factored second moments, no momentum) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, factored_zeros, finish_statistics, fp32_zeros_like, move_statistic, stacked_runs, start_factored_step,
    updates_and_clip_divisors,
)
from sdxl_trainer.optimizers.stochastic_rounding import keys_by_first_tensor, store_run
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
    Same-shaped tensors step together, stacked in runs of up to 16 M values (StackedRun): 44 shapes among
    SDXL's 1,680 tensors. Sharded, a run's update is computed twice, before and after its RMS over every shard
    is known, so no more than one run's update is held at a time (updates_and_clip_divisors); over bf16
    weights a run is rounded at once, keyed by its first tensor's step count and number."""

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

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, step counts) where `finite` (a bool scalar on the device) is
        False; None: always."""
        for group, entries in _entries_per_group(self, self._new_state):
            shard_group, verdict, steps = start_factored_step(entries, finite)
            runs = stacked_runs(entries)
            counts = torch.stack([steps[entry.index] for run in runs for entry in run.entries])
            # 1 - beta2 of this step, for each tensor; 0 where the update is skipped (the moments stay).
            weights_of_new = torch.where(verdict, counts.pow(group["decay_rate"]), 0.0).split([len(run) for run in runs])

            # The second moments: unfactored ones and rows are local, columns and mean rows need every shard.
            sums: list[torch.Tensor] = []
            moved = [move_statistic(run, "exp_avg_sq", run.grads().square_().add_(group["eps"]), weight, sums) for run, weight in zip(runs, weights_of_new)]
            moment_scales = finish_statistics(runs, moved, sums, shard_group, "exp_avg_sq", weights_of_new)

            keys = keys_by_first_tensor([run.entries for run in runs], steps)  # bf16 weights: the runs' rounding keys
            updates = updates_and_clip_divisors(runs, moment_scales, shard_group, group["clip_threshold"])
            for number, (run, update, divisors) in enumerate(updates):
                weights = run.weights()
                decayed = weights * (1 - group["lr"] * group["weight_decay"]) if group["weight_decay"] else weights
                # Clipped, scaled by the learning rate and subtracted in one operator: a factor per tensor.
                stepped = decayed.addcmul(update, run.per_tensor(torch.div(-group["lr"], divisors), update))
                # A skipped update's moments may still hold zeros (skipped first updates), whose update is not finite.
                store_run([entry.weights for entry in run.entries], torch.where(verdict, stepped, weights).view(-1), keys, number)
