"""Optimizers that work on FSDP2's DTensor parameters and save through torch.distributed.checkpoint.

8-bit AdamW comes from torchao, not bitsandbytes: bitsandbytes' kernels have no DTensor sharding rule
(`NotImplementedError: ... optimizer_update_32bit ... does not have a sharding strategy registered`),
while torchao's AdamW8bit steps DTensor shards directly and its state is saved by DCP (DESIGN.md §2).
"""

from __future__ import annotations

from typing import Iterable

import torch

OPTIMIZERS = ("adamw8bit", "adamw")


def build_optimizer(
    name: str, parameters: Iterable[torch.nn.Parameter], learning_rate: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    parameters = list(parameters)
    if name == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {OPTIMIZERS}")
