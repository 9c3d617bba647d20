"""Lion (sign updates, one fp32 momentum) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import _entries_per_group, _step_counts, _store_all, fp32_zeros_like, runs_of_at_most

# Values per multi-tensor op: the step's temporaries are a few fp32 copies of the values it updates at once,
# so it updates the parameters in runs of at most this many values (64 MB each in fp32), not all at once.
CHUNK_VALUES = 1 << 24


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is the sign of an
    interpolation of momentum and gradient, so every weight moves by exactly lr. Use a 3-10x smaller
    learning rate and a 3-10x larger weight decay than with AdamW. Over bf16 weights the momentum stays
    fp32 and a step count (the key of the stochastic rounding) joins the state.

    Every operation is elementwise, so it runs on each rank's local shards, many tensors per multi-tensor op:
    on DTensors every op of every parameter cost a DTensor dispatch (SDXL's UNet has 1,680 parameters)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        state = {"exp_avg": fp32_zeros_like(param)}
        if param.dtype != torch.float32:
            state["step"] = torch.tensor(0.0)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group, entries in _entries_per_group(self, self._new_state):
            beta1, beta2 = group["betas"]
            steps = dict(zip((entry.index for entry in entries), _step_counts(entries)))
            for chunk in runs_of_at_most(entries, [entry.weights.numel() for entry in entries], CHUNK_VALUES):
                grads = [entry.grad.float() for entry in chunk]
                momenta = [local_shard(entry.state["exp_avg"]) for entry in chunk]
                weights = torch._foreach_mul([entry.weights.float() for entry in chunk], 1 - group["lr"] * group["weight_decay"])
                directions = torch._foreach_lerp(momenta, grads, 1 - beta1)
                torch._foreach_sign_(directions)
                torch._foreach_add_(weights, directions, alpha=-group["lr"])
                _store_all(chunk, weights, [steps[entry.index] for entry in chunk])
                torch._foreach_lerp_(momenta, grads, 1 - beta2)
