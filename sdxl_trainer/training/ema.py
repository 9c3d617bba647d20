"""Exponential moving average of the UNet weights, kept as shards like the weights themselves.

Each rank averages only its own shard of every parameter (FSDP2 parameters are DTensors; their local
shards are plain tensors), so the EMA costs 1/N of an fp32 UNet per rank, on the GPU or, with
on_cpu=True, in CPU memory (each update then copies the rank's shard to the CPU). For checkpoints and
export the shards are wrapped back into DTensors with the parameters' layout, so DCP can reshard them and
the full EMA UNet can be gathered one tensor at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdxl_trainer.config import option
from sdxl_trainer.distributed.fsdp import parameter_names, reshard_units
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import flatten_tensors, runs_of_at_most, unflatten_tensors

# Values whose evaluation weights, or bf16 weights cast to fp32, are made at once (fp32 temporaries of 64 MB).
EVALUATION_RUN_VALUES = 1 << 24


@dataclass(kw_only=True)
class EMAOptions:
    """EMA of the UNet weights"""

    use_ema: bool = option(False, help="keep an exponential moving average of the UNet weights; the export then holds the EMA weights")
    ema_decay: float = option(0.9999, help="EMA decay per update (warmed up as min(decay, (1+n)/(10+n)))")
    ema_on_cpu: bool = option(False, help="keep each rank's EMA shard in CPU memory instead of GPU memory")

    def problems(self) -> list[str]:
        if not 0 < self.ema_decay < 1:
            return [f"--ema_decay must be between 0 and 1 (typically 0.999-0.9999), got {self.ema_decay}"]
        return []


def _laid_out_like(parameter: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` as a DTensor with the parameter's mesh, placements and global shape (plain tensors pass)."""
    if not isinstance(parameter, DTensor):
        return shard
    return DTensor.from_local(shard, parameter.device_mesh, parameter.placements, shape=parameter.shape, stride=parameter.stride(), run_check=False)


class ShardedEMA:
    """An exponential moving average of the trained weights, each rank keeping its own shards' (fp32).

    With on_cpu the average lives in host memory: each update's weights are copied there without waiting
    (into pinned staging buffers on a GPU machine, with the verdict beside them) and averaged in at the next
    update, or when the average is read, by which time the copies are long done: the host never waits for
    the update to finish, where a blocking copy of every shard would have made it wait at every update."""

    def __init__(self, model: nn.Module, decay: float, on_cpu: bool,
                 evaluation_weights: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None):
        """evaluation_weights: the weights to average, as fp32 local shards of the given parameters, where they are
        not the parameters' own (schedule-free AdamW's averaged x: optimizers/build.evaluation_weights_of); None:
        the parameters' weights."""
        self.decay = decay
        self.evaluation_weights = evaluation_weights
        self.updates = 0
        self.on_cpu = on_cpu
        self.names = parameter_names(model)  # as the state dict names them (no checkpoint-wrapper prefix)
        self.parameters = [parameter for _, parameter in model.named_parameters()]
        self.model = model
        # The parameters' indices in runs whose fp32 weights (evaluation weights, or bf16 weights cast) are made at
        # once: they are new fp32 tensors, so all of them at once would be a whole fp32 copy of this rank's shards
        # beside the average.
        sizes = [local_shard(parameter).numel() for parameter in self.parameters]
        self._runs = list(runs_of_at_most(list(range(len(self.parameters))), sizes, EVALUATION_RUN_VALUES))
        self._weights_are_fp32 = all(local_shard(parameter).dtype == torch.float32 for parameter in self.parameters)
        device = torch.device("cpu") if on_cpu else None
        self.shadow = [local_shard(parameter).detach().to(device=device, dtype=torch.float32, copy=True) for parameter in self.parameters]
        pinned = on_cpu and torch.cuda.is_available()
        # with on_cpu: the last update's weights and verdict on the host, not averaged in yet (_average_staged);
        # evaluation weights are fp32 whatever the parameters' dtype
        staged_dtype = torch.float32 if evaluation_weights is not None else None
        self._staged = [torch.empty_like(local_shard(parameter), dtype=staged_dtype, device="cpu", pin_memory=pinned) for parameter in self.parameters] if on_cpu else []
        self._staged_verdict = torch.ones((), dtype=torch.bool, pin_memory=pinned)
        self._staged_weight_of_new: float | None = None  # None: nothing staged
        self._staged_copied = None  # a CUDA event after the copies, on a GPU machine

    def bytes_held(self) -> int:
        """This rank's memory for the average: its fp32 shards, and with on_cpu the staged weights beside them."""
        return sum(tensor.numel() * tensor.element_size() for tensor in (*self.shadow, *self._staged))

    def current_decay(self) -> float:
        """Warm-up: (1 + n) / (10 + n) caps the decay early on, so the average is not dominated by the
        untrained starting weights for thousands of updates (the schedule diffusers' EMAModel uses)."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, finite: torch.Tensor | None = None) -> None:
        """Average in the current weights. `finite`: the update's verdict as a bool scalar on the device (TrainStep
        decides a skip there); where False the average stays as it is. The warm-up counts every update seen,
        skipped ones too, so the host never reads the verdict."""
        weight_of_new = 1 - self.current_decay()
        self.updates += 1
        if self.on_cpu:
            self._average_staged()
            self._stage(weight_of_new, finite)
            return
        # The same fp32 weight as the scalar's where finite, 0 (the average unchanged) where not: made once for every run.
        weight = weight_of_new if finite is None else finite.to(torch.float32) * weight_of_new
        if self.evaluation_weights is not None:
            for run in self._runs:
                new = self.evaluation_weights([self.parameters[index] for index in run])
                torch._foreach_lerp_([self.shadow[index] for index in run], new, weight)
            return
        weights = [local_shard(parameter).detach() for parameter in self.parameters]
        if self._weights_are_fp32:
            torch._foreach_lerp_(self.shadow, weights, weight)
            return
        # bf16 weights (--weights_dtype bf16): cast a run at a time, in one operator each, where casting every tensor
        # on its own cost an operator per tensor (1,680 an update at SDXL's count) and made a whole fp32 copy at once.
        for run in self._runs:
            in_run = [weights[index] for index in run]
            torch._foreach_lerp_([self.shadow[index] for index in run], unflatten_tensors(flatten_tensors(in_run).float(), in_run), weight)

    def _stage(self, weight_of_new: float, finite: torch.Tensor | None) -> None:
        """This update's weights and verdict copied to the host, queued behind the update (non-blocking)."""
        if self.evaluation_weights is None:
            torch._foreach_copy_(self._staged, [local_shard(parameter).detach() for parameter in self.parameters], non_blocking=True)
        else:
            for run in self._runs:
                torch._foreach_copy_([self._staged[index] for index in run], self.evaluation_weights([self.parameters[index] for index in run]),
                                     non_blocking=True)
        if finite is None:
            self._staged_verdict.fill_(True)
        else:
            self._staged_verdict.copy_(finite, non_blocking=True)
        self._staged_weight_of_new = weight_of_new
        if torch.cuda.is_available():
            self._staged_copied = torch.cuda.Event()
            self._staged_copied.record()

    def _average_staged(self) -> None:
        """The staged update averaged in (with on_cpu): after its copies, queued an update or more ago."""
        if self._staged_weight_of_new is None:
            return
        if self._staged_copied is not None:
            self._staged_copied.synchronize()
        current = [staged.float() for staged in self._staged]
        torch._foreach_lerp_(self.shadow, current, self._staged_verdict.to(torch.float32) * self._staged_weight_of_new)
        self._staged_weight_of_new = None

    def state_dict(self) -> dict:
        """"weights": parameter name -> EMA weights as a DTensor laid out like the parameter (DCP saves and
        reshards them; with on_cpu they sit on the CPU), and "updates": how many updates it has seen."""
        self._average_staged()
        weights = {name: _laid_out_like(parameter, shadow) for name, parameter, shadow in zip(self.names, self.parameters, self.shadow)}
        return {"weights": weights, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self._staged_weight_of_new = None
        for name, shadow in zip(self.names, self.shadow):
            shadow.copy_(local_shard(state["weights"][name]))
        self.updates = state["updates"]

    @contextlib.contextmanager
    def weights_in_model(self) -> Iterator[None]:
        """The EMA weights in the model's own parameters for the block (to score the weights that get
        exported); the trained weights come back afterwards, bit for bit. Not collective: each rank swaps
        its own shards. Costs one more copy of this rank's shards while it lasts. FSDP2 units still gathered
        (after a forward without backward) are resharded at both ends, so no gathered copy outlives the swap."""
        self._average_staged()
        reshard_units(self.model)
        with torch.no_grad():
            trained = [local_shard(parameter).detach().to(shadow.device, copy=True) for parameter, shadow in zip(self.parameters, self.shadow)]
            for parameter, shadow in zip(self.parameters, self.shadow):
                local_shard(parameter).copy_(shadow)
        try:
            yield
        finally:
            reshard_units(self.model)
            with torch.no_grad():
                for parameter, weights in zip(self.parameters, trained):
                    local_shard(parameter).copy_(weights)

    def full_state_dict_on_rank0(self, is_main: bool) -> dict[str, torch.Tensor]:
        """The full EMA UNet in CPU memory of rank 0 ({} elsewhere), gathered one tensor at a time."""
        self._average_staged()
        full = {}
        for name, parameter, shadow in zip(self.names, self.parameters, self.shadow):
            gathered = _laid_out_like(parameter, shadow.to(local_shard(parameter).device))
            if isinstance(gathered, DTensor):
                gathered = gathered.full_tensor()
            if is_main:
                full[name] = gathered.cpu()
        return full
