"""Lion (sign updates, one fp32 momentum) over local shards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import (
    StepsIfFinite, _entries_per_group, device_step_counts, entries_by_kind, flatten_tensors, fp32_zeros_like, runs_of_at_most,
    unflatten_tensors,
)
from sdxl_trainer.optimizers.stochastic_rounding import keys_by_first_tensor, store_run

# Values per chunk: the step's temporaries are a few fp32 copies of the values it updates at once, so it
# updates the parameters in runs of at most this many values (64 MB each in fp32), not all at once.
CHUNK_VALUES = 1 << 24


def _lion(weights: torch.Tensor, grads: torch.Tensor, momenta: torch.Tensor, lr: float, beta1: float, beta2: float, weight_decay: float,
          finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lion update of flat fp32 values; weights and momenta come back unchanged where `finite` (the
    update's verdict, a bool scalar on the device) is False."""
    new_weights = weights * (1 - lr * weight_decay)
    new_weights = torch.add(new_weights, momenta.lerp(grads, 1 - beta1).sign_(), alpha=-lr)
    new_momenta = momenta.lerp(grads, 1 - beta2)
    return torch.where(finite, new_weights, weights), torch.where(finite, new_momenta, momenta)


class Lion(StepsIfFinite, torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is the sign of an
    interpolation of momentum and gradient, so every weight moves by exactly lr. Use a 3-10x smaller
    learning rate and a 3-10x larger weight decay than with AdamW. Over bf16 weights the momentum stays
    fp32 and a step count (the key of the stochastic rounding) joins the state.

    Every operation is elementwise, so it runs on each rank's local shards, concatenated into flat runs of many
    tensors (on DTensors every op of every parameter cost a DTensor dispatch; SDXL's UNet has 1,680
    parameters). A skipped update (step(finite=...), StepsIfFinite) is selected in those runs on the device."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        state = {"exp_avg": fp32_zeros_like(param)}
        if param.dtype != torch.float32:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local_shard(param).device)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, momenta, step counts) where `finite` (a bool scalar on the device) is
        False; None: always. Nothing here reads a value from the device."""
        for group, entries in _entries_per_group(self, self._new_state):
            beta1, beta2 = group["betas"]
            for kind_entries in entries_by_kind(entries):
                device = kind_entries[0].weights.device
                verdict = torch.ones((), dtype=torch.bool, device=device) if finite is None else finite.to(device)
                steps = device_step_counts(kind_entries, verdict)
                chunks = list(runs_of_at_most(kind_entries, [entry.weights.numel() for entry in kind_entries], CHUNK_VALUES))
                keys = keys_by_first_tensor(chunks, steps)  # bf16 weights: the chunks' rounding keys
                for number, chunk in enumerate(chunks):
                    momenta = [local_shard(entry.state["exp_avg"]) for entry in chunk]
                    weights = [entry.weights for entry in chunk]
                    new_weights, new_momenta = _lion(
                        flatten_tensors(weights).float(), flatten_tensors([entry.grad for entry in chunk]).float(),
                        flatten_tensors(momenta), group["lr"], beta1, beta2, group["weight_decay"], verdict,
                    )  # fmt: skip
                    torch._foreach_copy_(momenta, unflatten_tensors(new_momenta, momenta))
                    store_run(weights, new_weights, keys, number)
