"""CAME (factored second moments, a momentum, and a factored confidence in it) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, factored_zeros, finish_statistics, fp32_zeros_like, move_statistic, normalised, stacked_runs,
    start_factored_step, updates_and_clip_divisors,
)
from sdxl_trainer.optimizers.stochastic_rounding import keys_by_first_tensor, store_run


class CAME(StepsIfFinite, torch.optim.Optimizer):
    """CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization"): Adafactor's
    factored second moments (beta2, no bias correction) normalise the gradient, the result is clipped to an
    RMS of at most clip_threshold and averaged into a momentum (beta1); the momentum's deviation from each new
    update, the "instability", gets factored moments of its own (beta3), and a weight of 2 or more dims moves
    by its momentum divided by their root: far where the momentum has agreed with the updates, little where
    it has not. A weight of 1 dim keeps a full second moment and moves by its momentum. The state is one fp32
    momentum per weight (4 bytes) plus the factored statistics (a few values per row and column).

    It is the update of came_pytorch.CAME, the authors' reference, for weights of 1 and 2 dims (tested to fp32
    rounding); a weight of more dims is factored over (dim 0, all other dims flattened), as our Adafactor does
    (the reference factors a conv kernel's last two dims, 3x3), so it steps as the reference steps the
    (out_channels, rest) matrix.

    It steps each rank's local shards. FSDP2 splits dim 0, so row statistics and elementwise ops are local;
    what needs every row is summed over the shards for all parameters of a group at once, in three
    all-reduces per update: the squared gradients' column sums with the row statistics' sums (the second
    moments), then the updates' sums of squares (their RMS, for clipping), then the instability's column sums
    with its row statistics' sums. So the shards step exactly as the whole weights would, to the rounding of
    those sums. Nothing is read on the host: a skipped update (step(finite=...), StepsIfFinite) gives the new
    values a weight of 0 and keeps the weights; over bf16 weights a step count (the key of the stochastic
    rounding) joins the state. Same-shaped tensors step together, stacked in runs of up to 16 M values
    (StackedRun), as Adafactor's do. Sharded, a run's update is computed twice, before and after its RMS over
    every shard is known, so no more than one run's update is held at a time (updates_and_clip_divisors)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, clip_threshold=clip_threshold, weight_decay=weight_decay))

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        state = {"exp_avg": fp32_zeros_like(param)}
        if param.dtype != torch.float32:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local_shard(param).device)
        if param.ndim < 2:
            state["exp_avg_sq"] = fp32_zeros_like(param)
            return state
        state["exp_avg_sq_row"], state["exp_avg_sq_col"] = factored_zeros(param)
        state["exp_avg_res_row"], state["exp_avg_res_col"] = factored_zeros(param)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, step counts) where `finite` (a bool scalar on the device) is
        False; None: always."""
        for group, entries in _entries_per_group(self, self._new_state):
            shard_group, verdict, steps = start_factored_step(entries, finite)
            runs = stacked_runs(entries)
            beta1, beta2, beta3 = group["betas"]
            eps_squared, eps_instability = group["eps"]
            # 1 - beta of this step: 0 where the update is skipped (the moments stay).
            momentum_weight, square_weight, instability_weight = (torch.where(verdict, 1 - beta, 0.0) for beta in (beta1, beta2, beta3))

            # Second moments: unfactored ones and rows are local; columns and the mean row need every shard.
            sums: list[torch.Tensor] = []
            moved = [move_statistic(run, "exp_avg_sq", run.grads().square_().add_(eps_squared), square_weight, sums) for run in runs]
            moment_scales = finish_statistics(runs, moved, sums, shard_group, "exp_avg_sq", [square_weight] * len(runs))

            # The momentum, and the instability (its deviation from the clipped update) of factored weights.
            sums, moved = [], []
            for run, update, divisors in updates_and_clip_divisors(runs, moment_scales, shard_group, group["clip_threshold"]):
                update.div_(run.per_tensor(divisors, update))
                momentum = run.state("exp_avg")
                if finite is not None:  # a skipped first update's zero moments make it 0/0: weigh the momentum itself
                    update = torch.where(verdict, update, momentum)
                run.store("exp_avg", momentum.lerp_(update, momentum_weight))
                instability = (update - momentum).square_().add_(eps_instability) if run.factored else None
                moved.append(None if instability is None else move_statistic(run, "exp_avg_res", instability, instability_weight, sums))
            instability_scales = finish_statistics(runs, moved, sums, shard_group, "exp_avg_res", [instability_weight] * len(runs))

            # Each weight moves by its momentum, divided by the root of its instability where it is factored.
            keys = keys_by_first_tensor([run.entries for run in runs], steps)  # bf16 weights: the runs' rounding keys
            for number, (run, scales) in enumerate(zip(runs, instability_scales)):
                direction = run.state("exp_avg")
                if scales is not None:
                    direction = normalised(direction, scales)
                weights = run.weights()
                decayed = weights * (1 - group["lr"] * group["weight_decay"]) if group["weight_decay"] else weights
                # A skipped update's instability may still hold zeros (skipped first updates), whose update is not finite.
                new_weights = torch.where(verdict, decayed.add(direction, alpha=-group["lr"]), weights)
                store_run([entry.weights for entry in run.entries], new_weights.view(-1), keys, number)
