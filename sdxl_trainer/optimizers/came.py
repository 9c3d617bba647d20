"""CAME (factored second moments, a momentum, and a factored confidence in it) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, _Entry, _sum_over_shards, factored_zeros, fp32_zeros_like, host_values_to, scaled_by_factors,
    start_factored_step,
)
from sdxl_trainer.optimizers.stochastic_rounding import rounding_keys, store_weights


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
    rounding) joins the state. Each parameter's update is computed twice, before and after its RMS is known,
    so no more than one parameter's update is held at a time."""

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

    @staticmethod
    def _normalised(entry: _Entry, row_mean: torch.Tensor | None) -> torch.Tensor:
        """The gradient over the root of its second moment (already this step's), before clipping; `row_mean`:
        the mean of a factored weight's row statistics over all its rows."""
        grad = entry.grad.float()
        if row_mean is None:
            return grad * local_shard(entry.state["exp_avg_sq"]).rsqrt()
        return scaled_by_factors(grad, local_shard(entry.state["exp_avg_sq_row"]), row_mean, local_shard(entry.state["exp_avg_sq_col"]))

    @staticmethod
    def _move_rows(entry: _Entry, name: str, flat: torch.Tensor, weight_of_new: torch.Tensor) -> list[torch.Tensor]:
        """Moves a factored entry's row statistics `name`_row (local) towards the row means of `flat` (rows x
        columns); returns what its column statistics and mean row need from every row: the column sums of
        `flat` and the sum of the row statistics."""
        rows = local_shard(entry.state[f"{name}_row"])
        rows.lerp_(flat.mean(1), weight_of_new)
        return [flat.sum(0), rows.sum().reshape(1)]

    @staticmethod
    def _move_columns(
        entries: list[_Entry], sums: list[torch.Tensor], shard_group: tuple, name: str, weight_of_new: torch.Tensor,
    ) -> list[torch.Tensor | None]:
        """`sums` (_move_rows's, of every factored entry in order) summed over the shards in one all-reduce; then
        each factored entry's column statistics `name`_col moved towards the column means. Returns each entry's
        mean row statistic (None for an unfactored entry)."""
        summed = iter(_sum_over_shards(torch.cat(sums), shard_group).split([part.numel() for part in sums])) if sums else iter(())
        row_means = []
        for entry in entries:
            if f"{name}_col" not in entry.state:
                row_means.append(None)
                continue
            row_count = entry.param.shape[0]
            local_shard(entry.state[f"{name}_col"]).lerp_(next(summed) / row_count, weight_of_new)
            row_means.append(next(summed) / row_count)
        return row_means

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, step counts) where `finite` (a bool scalar on the device) is
        False; None: always."""
        for group, entries in _entries_per_group(self, self._new_state):
            shard_group, verdict, steps = start_factored_step(entries, finite)
            beta1, beta2, beta3 = group["betas"]
            eps_squared, eps_instability = group["eps"]
            # 1 - beta of this step: 0 where the update is skipped (the moments stay).
            momentum_weight, square_weight, instability_weight = (torch.where(verdict, 1 - beta, 0.0) for beta in (beta1, beta2, beta3))

            # Second moments: unfactored ones and rows are local; columns and the mean row need every shard.
            sums = []
            for entry in entries:
                squared = entry.grad.float().square().add_(eps_squared)
                if "exp_avg_sq" in entry.state:
                    local_shard(entry.state["exp_avg_sq"]).lerp_(squared, square_weight)
                else:
                    sums += self._move_rows(entry, "exp_avg_sq", squared.flatten(1), square_weight)
            row_means = self._move_columns(entries, sums, shard_group, "exp_avg_sq", square_weight)

            # The normalised gradients' RMS over every shard: each one's clipping divisor.
            squares = torch.stack([self._normalised(entry, row_mean).square().sum() for entry, row_mean in zip(entries, row_means)])
            norms = _sum_over_shards(squares, shard_group)
            numels = host_values_to([float(entry.param.numel()) for entry in entries], torch.float32, norms.device)
            clip_divisors = ((norms.sqrt() / numels.sqrt()) / group["clip_threshold"]).clamp(min=1.0)

            # The momentum, and the instability (its deviation from the clipped update) of factored weights.
            sums = []
            for entry, row_mean, clip_divisor in zip(entries, row_means, clip_divisors):
                update = self._normalised(entry, row_mean).div_(clip_divisor)
                momentum = local_shard(entry.state["exp_avg"])
                if finite is not None:  # a skipped first update's zero moments make it 0/0: weigh the momentum itself
                    update = torch.where(verdict, update, momentum)
                momentum.lerp_(update, momentum_weight)
                if row_mean is not None:
                    instability = (update - momentum).square_().add_(eps_instability)
                    sums += self._move_rows(entry, "exp_avg_res", instability.flatten(1), instability_weight)
            instability_means = self._move_columns(entries, sums, shard_group, "exp_avg_res", instability_weight)

            # Each weight moves by its momentum, divided by the root of its instability where it is factored.
            keys = None  # bf16 weights: each tensor's key from its step count and number
            if any(entry.weights.dtype == torch.bfloat16 for entry in entries):
                keys = rounding_keys(torch.stack([steps[entry.index] for entry in entries]), [entry.index for entry in entries])
            for number, (entry, instability_mean) in enumerate(zip(entries, instability_means)):
                direction = local_shard(entry.state["exp_avg"])
                if instability_mean is not None:
                    direction = scaled_by_factors(
                        direction, local_shard(entry.state["exp_avg_res_row"]), instability_mean, local_shard(entry.state["exp_avg_res_col"])
                    )
                weights = entry.weights.float()
                if group["weight_decay"]:
                    weights = weights * (1 - group["lr"] * group["weight_decay"])
                # A skipped update's instability may still hold zeros (skipped first updates), whose update is not finite.
                store_weights(entry.weights, torch.where(verdict, weights - group["lr"] * direction, entry.weights.float()), keys, number)
