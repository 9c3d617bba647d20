"""The optimizer a run asks for (--optimizer), and the memory its state takes.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from sdxl_trainer.optimizers.adafactor import Adafactor
from sdxl_trainer.optimizers.adamw import ShardAdamW
from sdxl_trainer.optimizers.lion import Lion

OPTIMIZERS = ("adamw8bit", "adamw", "adafactor", "lion")


# beta2 when --adam_beta2 is not given: AdamW's usual value, and the Lion paper's (Chen et al. 2023, 0.99:
# Lion's update is the sign of an interpolation, and 0.999 makes its momentum too slow).
DEFAULT_BETA2 = {"adamw8bit": 0.999, "adamw": 0.999, "lion": 0.99}


def build_optimizer(
    name: str, parameters: Iterable[torch.nn.Parameter] | list[dict], learning_rate: float, weight_decay: float, betas: tuple[float, float | None], eps: float,
    loss_scaling: bool = False,
) -> torch.optim.Optimizer:
    """`parameters`: parameters, or param groups (dicts with their own "lr"). betas and eps apply to the
    AdamW variants; Lion uses betas; Adafactor uses neither. A beta2 of None takes the optimizer's default
    (DEFAULT_BETA2). `loss_scaling`: fp16 training, stepped through a ShardedGradScaler."""
    parameters = list(parameters)
    betas = (betas[0], DEFAULT_BETA2.get(name, 0.999) if betas[1] is None else betas[1])
    if name == "adamw8bit":
        from sdxl_trainer.optimizers.adamw8bit import AdamW8bit

        return AdamW8bit(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        if any(parameter.dtype == torch.bfloat16 for parameter in _all_parameters(parameters)):
            from sdxl_trainer.optimizers.adamw8bit import AdamWFp32Moments

            return AdamWFp32Moments(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
        if not loss_scaling:
            return ShardAdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
        # With loss scaling the scaler hands a fused kernel its overflow flag, and ShardedGradScaler's (shape
        # [1]) fails there ("output with shape [] doesn't match the broadcast shape [1]"): the scaler skips
        # the multi-tensor step instead (over DTensors; its first update costs seconds more on a CPU).
        return torch.optim.AdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
    if name == "adafactor":
        return Adafactor(parameters, lr=learning_rate, weight_decay=weight_decay)
    if name == "lion":
        return Lion(parameters, lr=learning_rate, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {OPTIMIZERS}")


def _all_parameters(parameters: list) -> list[torch.Tensor]:
    return [parameter for entry in parameters for parameter in (entry["params"] if isinstance(entry, dict) else [entry])]


def local_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank stores (its shards; torchao's 8-bit state counted as stored)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += _stored_bytes(local)
    return total


def _stored_bytes(tensor: torch.Tensor) -> int:
    # torchao's quantized state is a tensor subclass whose real storage is its inner tensors (codes + scales).
    inner_names = getattr(tensor, "__tensor_flatten__", None)
    if inner_names is not None and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
