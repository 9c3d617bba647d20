"""Schedule-free AdamW over local shards: the parameters hold the sequence it trains at (y); the weights to
evaluate and export (x) are worked out from y and its state on demand.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, flatten_tensors, fp32_zeros_like, one_tensor_in_every_state, runs_by_kind, unflatten_tensors,
)
from sdxl_trainer.optimizers.stochastic_rounding import rounding_keys, store_run

# Values per chunk: the step's temporaries are a few fp32 copies of the values it updates at once (Lion's size).
CHUNK_VALUES = 1 << 24
# The state key of the scalars every parameter of a group shares (one tensor: state/save.py saves per-parameter
# state only): the updates taken, the sum of the averaging weights so far, and the largest learning rate so far.
SHARED = "schedule_free_averaging"
UPDATES, WEIGHT_SUM, LR_MAX = range(3)


class ScheduleFreeAdamW(StepsIfFinite, torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"): no learning-rate decay; instead the
    weights to use (x) are an average of the iterates (z), weighted by the squared learning rate of the update
    that made each, and gradients are taken at y, between the two (y = (1 - beta1) z + beta1 x). The update is
    schedulefree's AdamWScheduleFree (1.4.1, r = 0, weight_lr_power = 2): tested against it. Its own warm-up
    is the trainer's schedule here (--learning_rate_scheduler constant_with_warmup); a decaying schedule is
    refused, the averaging replaces it.

    The parameters hold y, which training needs, and the state z and the second moment (8 bytes per weight in
    fp32). schedulefree swaps x into the parameters (eval()) and back (train()) in place, which is not exact in
    floating point; here x is computed when asked for (evaluation_weights): validation, samples, the EMA and
    exports read it, while y and its checkpoints stay bit for bit (training/trained_models.py).

    Every operation is elementwise and runs on flat runs of many local shards (as Lion). The scalars of the
    averaging (update count, sum of weights, largest rate) live on the device, in every parameter's state as
    one tensor per group (SHARED), so a skipped update (step(finite=...), StepsIfFinite) leaves them, the
    weights and the state as they were without the host reading anything. Over bf16 weights y is rounded
    stochastically, and z and the moment stay fp32."""

    steps_in_parts = (
        "its averaging scalars (updates taken, sum of weights, largest rate) are one tensor shared by every parameter "
        "and move once per whole step"
    )

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        # z starts at the weights, in fp32 (a DTensor laid out as the weights, made from the local shard).
        z = fp32_zeros_like(param)
        local_shard(z).copy_(local_shard(param))
        return {"z": z, "exp_avg_sq": fp32_zeros_like(param)}

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, z, moments, averaging) where `finite` (a bool scalar on the device) is
        False; None: always. Nothing here reads a value from the device."""
        for group, entries in _entries_per_group(self, self._new_state):
            device = entries[0].weights.device
            shared = one_tensor_in_every_state(
                [entry.state for entry in entries], SHARED, lambda: torch.zeros(3, dtype=torch.float64, device=device)
            )  # fmt: skip
            verdict = torch.ones((), dtype=torch.bool, device=shared.device) if finite is None else finite.to(shared.device)
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            updates, weight_sum, lr_max = shared.unbind()
            new_updates = updates + 1
            bias_correction2 = 1 - beta2**new_updates
            new_lr_max = torch.clamp(lr_max, min=lr)
            weight = new_lr_max**2  # each iterate's weight in the average: the largest rate so far, squared
            new_weight_sum = weight_sum + weight
            # The new iterate's share of the average; 0 while every weight is 0 (a warm-up's first update at rate 0).
            share = torch.where(new_weight_sum > 0, weight / new_weight_sum, 0.0)
            y_step = lr * (beta1 * (1 - share) - 1)
            chunks = list(runs_by_kind(entries, CHUNK_VALUES))
            keys = None  # bf16 weights: each chunk keyed by the update count (kept where skipped) and its first tensor's number
            if any(chunk[0].weights.dtype == torch.bfloat16 for chunk in chunks):
                keys = rounding_keys(torch.where(verdict, new_updates, updates), [chunk[0].index for chunk in chunks])
            for number, chunk in enumerate(chunks):
                weights = [entry.weights for entry in chunk]
                z_list, sq_list = [local_shard(entry.state["z"]) for entry in chunk], [local_shard(entry.state["exp_avg_sq"]) for entry in chunk]
                y, grads = flatten_tensors(weights).float(), flatten_tensors([entry.grad for entry in chunk]).float()
                z, exp_avg_sq = flatten_tensors(z_list), flatten_tensors(sq_list)
                new_exp_avg_sq = exp_avg_sq * beta2 + grads * grads * (1 - beta2)
                update = grads / ((new_exp_avg_sq / bias_correction2).sqrt() + eps)
                if decay:
                    update = update + y * decay  # weight decay at y
                new_y = y.lerp(z, share.float()) + update * y_step
                new_z = z - update * lr
                torch._foreach_copy_(z_list, unflatten_tensors(torch.where(verdict, new_z, z), z_list))
                torch._foreach_copy_(sq_list, unflatten_tensors(torch.where(verdict, new_exp_avg_sq, exp_avg_sq), sq_list))
                store_run(weights, torch.where(verdict, new_y, y), keys, number)
            shared.copy_(torch.where(verdict, torch.stack([new_updates, new_weight_sum, new_lr_max]), shared))

    @torch.no_grad()
    def evaluation_weights(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights to evaluate and export (x), for each of `parameters`, as new fp32 tensors laid out as its
        local shard: x = y + (1 - 1/beta1) (z - y), as schedulefree's eval() computes it; a parameter not
        stepped yet gives its own weights (x = y = z at the start)."""
        beta1_of = {param: group["betas"][0] for group in self.param_groups for param in group["params"]}
        evaluated = []
        for param in parameters:
            weights = local_shard(param).detach()
            state = self.state.get(param)
            if state and "z" in state:
                evaluated.append(torch.lerp(weights.float(), local_shard(state["z"]), 1 - 1 / beta1_of[param]))
            else:
                evaluated.append(weights.to(torch.float32, copy=True))
        return evaluated
