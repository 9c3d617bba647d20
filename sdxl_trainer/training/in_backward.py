"""The optimizer step inside backward (--optimizer_in_backward): each unit's weights are stepped as soon as
their gradients are final, and those gradients are freed at once, so no GPU ever holds the whole model's
gradients (kohya sd-scripts' --fused_backward_pass and OneTrainer's fused back pass do this per tensor).

One mechanism serves one process and FSDP2: a post-accumulate-grad hook on every trained parameter. On one
process autograd calls it when the parameter's gradient is accumulated; under FSDP2, after each unit's
reduce-scatter, FSDP2 sets the sharded parameters' gradients (views into that unit's reduce-scatter output)
and calls the hooks of those sharded parameters (torch's _fsdp_collectives.foreach_reduce). A unit
(distributed.fsdp.gradient_units: FSDP2's units, or the same units of a plain module) is stepped when the
last of its parameters' hooks has fired, all of them together, so the optimizers keep their multi-tensor
kernels and a unit's reduce-scatter buffer is freed whole. A parameter that gets no gradient must not hold
its unit back: what has arrived of an incomplete unit is stepped when backward has ended (finish).

What differs from the ordinary step (TrainStep), by construction:
- No clipping by the global gradient norm, which exists only after the last unit's gradients: TrainStep is
  built with max_grad_norm 0 (the config refuses anything else). The global norm is still computed, from
  each unit's squared norm, and logged.
- The NaN/inf skip is decided per unit, on the device: a unit steps only where the update's loss (all-reduced
  before backward) and that unit's gradients (its squared norm, all-reduced over the ranks that hold other
  shards of it, so every rank takes the same decision) are finite. The update counts as skipped, and the EMA
  leaves it out, when any unit skipped; units that were finite have stepped. In the usual fault (a non-finite
  loss) every unit skips, as in the ordinary step.
- One microbatch per update: a step in backward cannot wait for the next microbatch's gradients (the config
  refuses --gradient_accumulation_steps > 1), and no fp16 loss scaling (the scaler needs every gradient to
  unscale and check before any step).
- Optimizers whose step needs every parameter before any moves (Prodigy, schedule-free AdamW:
  StepsIfFinite.steps_in_parts) are refused.
Each parameter gets the same arithmetic as in the ordinary step (with fp32 weights the same weights bit for
bit, tests/training/test_in_backward.py), and the same optimizer state and checkpoints. Two roundings can
differ, as a unit's chunks and runs are not the whole step's. Adafactor and CAME reduce each tensor inside a
stack of same-shaped tensors, and a large tensor's sum of squares (its update's RMS) can round differently
with the stack's length (seen on a 2-thread CPU for tensors of SDXL's sizes), so their weights may agree
only to fp32 rounding. With bf16 weights each chunk or run has its own key (the 8-bit AdamW numbers its
chunks per unit; Lion, Adafactor and CAME key one by its first tensor), so the stochastic rounding draws
other (still reproducible) bits than the ordinary step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sdxl_trainer.distributed.fsdp import gradient_units
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import StepsIfFinite
from sdxl_trainer.training.gradient_norm import squared_norm


@dataclass
class _Update:
    """One update's progress through backward."""

    loss_finite: torch.Tensor  # bool scalar on the training device
    arrived: list[list[torch.nn.Parameter]]  # per unit, the parameters whose gradient is final
    stepped: list[bool]
    squares: list[torch.Tensor] = field(default_factory=list)  # each stepped unit's squared gradient norm, all ranks
    verdicts: list[torch.Tensor] = field(default_factory=list)  # each stepped unit's verdict


class OptimizerInBackward:
    """Steps `optimizer` a unit at a time inside backward, between begin() and finish() (TrainStep)."""

    def __init__(self, optimizer: torch.optim.Optimizer, models: list[torch.nn.Module]):
        """`models`: the trained models (the UNet, and trained text encoders), whose units hold every parameter
        of the optimizer."""
        if not isinstance(optimizer, StepsIfFinite):
            raise ValueError(f"--optimizer_in_backward needs one of this trainer's optimizers (StepsIfFinite), got {type(optimizer).__name__}")
        if optimizer.steps_in_parts is not None:
            raise ValueError(f"--optimizer_in_backward cannot step {type(optimizer).__name__} a unit at a time: {optimizer.steps_in_parts}")
        self.optimizer = optimizer
        trained = {parameter for group in optimizer.param_groups for parameter in group["params"]}
        self.units = [unit for model in models for unit in ([p for p in part if p in trained] for part in gradient_units(model)) if unit]
        unit_of = {parameter: number for number, unit in enumerate(self.units) for parameter in unit}
        if len(unit_of) != len(trained):
            raise ValueError(f"{len(trained) - len(unit_of)} of the optimizer's parameters are in none of the trained models")
        self._unit_of = unit_of
        self.subsets = optimizer.subsets(self.units)
        self._update: _Update | None = None
        self._handles = [parameter.register_post_accumulate_grad_hook(self._gradient_final) for parameter in unit_of]

    def begin(self, loss_finite: torch.Tensor) -> None:
        """Before backward: the update's loss verdict (a bool scalar on the device, the same on every rank).
        The learning rate must be set by now."""
        self._update = _Update(loss_finite, [[] for _ in self.units], [False] * len(self.units))

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After backward: steps what arrived of units that did not complete, and returns the global gradient
        norm and whether every unit stepped (both on the device)."""
        update = self._update
        for unit, arrived in enumerate(update.arrived):
            if arrived and not update.stepped[unit]:
                self._step_unit(unit)
        self._update = None
        device = update.loss_finite.device
        if not update.squares:  # no gradient at all
            return torch.zeros((), device=device), update.loss_finite.clone()
        norm = torch.stack([squares.to(device) for squares in update.squares]).sum().sqrt()
        return norm, update.loss_finite & torch.stack([verdict.to(device) for verdict in update.verdicts]).all()

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()

    def _gradient_final(self, parameter: torch.nn.Parameter) -> None:
        update = self._update
        if update is None:
            raise RuntimeError("--optimizer_in_backward: a gradient reached a trained parameter outside a training update's backward")
        unit = self._unit_of[parameter]
        if update.stepped[unit]:
            raise RuntimeError(
                "--optimizer_in_backward: a second gradient reached a parameter whose unit has already stepped (a weight used twice "
                "in one forward on one process): train it without --optimizer_in_backward"
            )
        update.arrived[unit].append(parameter)
        if len(update.arrived[unit]) == len(self.units[unit]):
            self._step_unit(unit)

    @torch.no_grad()
    def _step_unit(self, unit: int) -> None:
        update = self._update
        parameters = update.arrived[unit]
        squares, _ = squared_norm([parameter.grad for parameter in parameters])
        verdict = update.loss_finite & torch.isfinite(squares).to(update.loss_finite.device)
        self.optimizer.step_subset(self.subsets[unit], finite=verdict)
        for parameter in parameters:
            grad = local_shard(parameter.grad)
            if grad.is_cuda:
                # Under FSDP2 this runs on its post-reduce stream, which with HSDP is not the stream the gradient was
                # made on: the memory must not be reused before this stream's step has read it.
                grad.record_stream(torch.cuda.current_stream(grad.device))
            parameter.grad = None
        update.stepped[unit] = True
        update.squares.append(squares)
        update.verdicts.append(verdict)
