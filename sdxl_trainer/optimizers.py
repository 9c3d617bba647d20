"""Optimizers that step FSDP2's DTensor shards and save through torch.distributed.checkpoint.

Which implementation, and why (each was tried on 2 gloo ranks with FSDP2 parameters):
- adamw8bit: torchao's AdamW8bit state with our multi-tensor step (adamw8bit.py). bitsandbytes' kernels
  have no DTensor sharding rule (`NotImplementedError: ... optimizer_update_32bit ... does not have a
  sharding strategy registered`), while torchao's quantized state lives in DTensor shards and DCP saves
  and reshards it (docs/design.md §2).
- adamw: torch.optim.AdamW (fused), fp32 state.
- adafactor: our own, below. torch.optim.Adafactor fails on DTensors (an in-place pow_ on a partial
  norm) and transformers' Adafactor mixes plain tensors into DTensor ops.
- lion: our own, below. The only 8-bit Lion (bitsandbytes) has the same missing DTensor rule as its
  AdamW8bit; Lion keeps one momentum buffer, already half of AdamW's fp32 state.
Both are written with out-of-place DTensor ops where a reduction crosses ranks, so a sharded step
equals the unsharded one.

bf16 weights (--weights_dtype bf16): every optimizer computes its update in fp32 and rounds the new
weights stochastically (stochastic_rounding.py), keyed by its step count; its own state stays fp32 (or
8-bit). torch's AdamW cannot do that, so --optimizer adamw over bf16 weights is AdamWFp32Moments, with
torch AdamW's state layout.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate

from .stochastic_rounding import rounding_key, store_weights

OPTIMIZERS = ("adamw8bit", "adamw", "adafactor", "lion")


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole on every rank (reductions over the sharded dim come out partial); plain tensors pass."""
    if isinstance(tensor, DTensor):
        return tensor.redistribute(placements=[Replicate()] * tensor.device_mesh.ndim)
    return tensor


def _parameters_with_grads(param_groups: list[dict]) -> Iterable[tuple[dict, int, torch.Tensor]]:
    """(group, number, parameter) for each parameter with a gradient; the number counts over all groups
    (the stream of its stochastic rounding)."""
    parameters = ((group, param) for group in param_groups for param in group["params"])
    for index, (group, param) in enumerate(parameters):
        if param.grad is not None:
            yield group, index, param


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is the sign of an
    interpolation of momentum and gradient, so every weight moves by exactly lr. Use a 3-10x smaller
    learning rate and a 3-10x larger weight decay than with AdamW. Over bf16 weights the momentum stays
    fp32 and a step count (the key of the stochastic rounding) joins the state."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group, index, param in _parameters_with_grads(self.param_groups):
            beta1, beta2 = group["betas"]
            state = self.state[param]
            if not state:
                state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                if param.dtype != torch.float32:
                    state["step"] = torch.tensor(0.0)
            exp_avg, grad = state["exp_avg"], param.grad.float()
            weights = param.float() * (1 - group["lr"] * group["weight_decay"])
            weights = weights.add(torch.sign(exp_avg.lerp(grad, 1 - beta1)), alpha=-group["lr"])
            if "step" in state:
                state["step"] += 1
            store_weights(param, weights, rounding_key(int(state.get("step", 0)), index))
            exp_avg.lerp_(grad, 1 - beta2)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with an explicit learning rate, no first moment and update clipping:
    the settings kohya sd-scripts users pass to transformers' Adafactor (relative_step=False,
    scale_parameter=False, warmup_init=False). Second moments of a weight with 2 or more dims are factored
    over (dim 0, all other dims flattened), so a conv kernel keeps one row and one column statistic."""

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

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group, index, param in _parameters_with_grads(self.param_groups):
            grad = param.grad.float()
            state = self.state[param]
            factored = param.ndim >= 2
            if not state:
                state["step"] = torch.tensor(0.0)
                if factored:
                    flat = grad.flatten(1)
                    state["exp_avg_sq_row"] = torch.zeros_like(flat.sum(1))
                    state["exp_avg_sq_col"] = _replicated(torch.zeros_like(flat.sum(0)))
                else:
                    state["exp_avg_sq"] = torch.zeros_like(grad)
            state["step"] += 1
            weight_of_new = state["step"].item() ** group["decay_rate"]  # 1 - beta2 of this step
            squared = grad * grad + group["eps"]
            if factored:
                flat = squared.flatten(1)
                row = state["exp_avg_sq_row"].lerp(flat.mean(1), weight_of_new)
                col = _replicated(state["exp_avg_sq_col"].lerp(_replicated(flat.mean(0)), weight_of_new))
                state["exp_avg_sq_row"], state["exp_avg_sq_col"] = row, col
                row_factor = (row / _replicated(row.mean())).rsqrt()
                update = (grad.flatten(1) * row_factor[:, None] * col.rsqrt()[None, :]).view_as(grad)
            else:
                state["exp_avg_sq"] = state["exp_avg_sq"].lerp(squared, weight_of_new)
                update = grad * state["exp_avg_sq"].rsqrt()
            rms = _replicated(update.norm()) / math.sqrt(update.numel())
            update = update / (rms / group["clip_threshold"]).clamp(min=1.0)
            weights = param.float()
            if group["weight_decay"]:
                weights = weights * (1 - group["lr"] * group["weight_decay"])
            store_weights(param, weights - update * group["lr"], rounding_key(int(state["step"]), index))


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
        from .adamw8bit import AdamW8bit

        return AdamW8bit(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        if any(parameter.dtype == torch.bfloat16 for parameter in _all_parameters(parameters)):
            from .adamw8bit import AdamWFp32Moments

            return AdamWFp32Moments(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
        # The fused kernel (torchtitan's default) works on DTensor shards in one op per update: the multi-tensor
        # path's dozen ops each cost DTensor a sharding propagation over every parameter at the first update
        # (measured on 2 CPU processes, tiny UNet: 8.9 s first update against 2.2 s fused; later ones equal).
        # With loss scaling the scaler hands a fused kernel its overflow flag, and ShardedGradScaler's (shape
        # [1]) fails there ("output with shape [] doesn't match the broadcast shape [1]"): the multi-tensor
        # path is skipped by the scaler instead.
        implementation = {"foreach": True} if loss_scaling else {"fused": True}
        return torch.optim.AdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, **implementation)
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
