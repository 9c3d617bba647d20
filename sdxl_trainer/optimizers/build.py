"""The optimizer a run asks for (--optimizer), and the memory its state takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

import torch

from sdxl_trainer.config import option
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.adafactor import Adafactor
from sdxl_trainer.optimizers.adamw import ShardAdamW
from sdxl_trainer.optimizers.came import CAME
from sdxl_trainer.optimizers.lion import Lion
from sdxl_trainer.optimizers.prodigy import Prodigy, ProdigySettings
from sdxl_trainer.optimizers.schedule_free import ScheduleFreeAdamW

OPTIMIZERS = ("adamw8bit", "adamw", "adafactor", "lion", "came", "prodigy", "adamw_schedulefree")


# beta2 when --adam_beta2 is not given: AdamW's usual value, and the Lion paper's (Chen et al. 2023, 0.99:
# Lion's update is the sign of an interpolation, and 0.999 makes its momentum too slow).
DEFAULT_BETA2 = {"adamw8bit": 0.999, "adamw": 0.999, "lion": 0.99, "came": 0.999}
# Prodigy's --learning_rate multiplies the step size it estimates: below this it is almost surely AdamW's rate left in.
PRODIGY_MIN_LEARNING_RATE = 0.1
# The schedules under which schedule-free AdamW's averaging is what it was made for: a constant rate, after a warm-up.
SCHEDULE_FREE_SCHEDULES = ("constant", "constant_with_warmup")
# Optimizers --optimizer_in_backward refuses, and why: their step needs every parameter before any weight moves.
IN_BACKWARD_REFUSED = {"prodigy": Prodigy.steps_in_parts, "adamw_schedulefree": ScheduleFreeAdamW.steps_in_parts}

@dataclass(kw_only=True)
class OptimizerOptions:
    """Optimizer"""

    optimizer: Literal["adamw8bit", "adamw", "adafactor", "lion", "came", "prodigy", "adamw_schedulefree"] = option(
        "adamw8bit",
        help="adamw8bit = 8-bit AdamW (torchao's state, 2 bytes per weight, stepped many tensors per kernel); adamw = fp32 AdamW (8 bytes); "
        "adafactor = factored second moments, no momentum (least memory); lion = sign updates, one fp32 momentum "
        "(4 bytes; use a 3-10x lower --learning_rate); came = Adafactor's factored moments and an fp32 momentum scaled by its "
        "factored confidence (4 bytes; its statistics start at zero without bias correction, so early updates run larger than "
        "--learning_rate: keep a warm-up); prodigy = AdamW that estimates its own step size (16 bytes; "
        "--learning_rate 1.0 multiplies the estimate); adamw_schedulefree = schedule-free AdamW, no decay to choose (8 bytes; "
        "a constant --learning_rate_scheduler; validation and exports use its averaged weights)",
    )
    learning_rate: float = option(1e-5, help="peak learning rate (with prodigy: the factor on its estimated step size, 1.0)")
    adam_beta1: float = option(
        0.9, help="beta1 of AdamW, Lion, CAME (its momentum), Prodigy and schedule-free AdamW (there: the interpolation between its sequences)"
    )
    adam_beta2: float | None = option(
        None,
        help="beta2 of AdamW, Lion, CAME, Prodigy and schedule-free AdamW; None = the optimizer's own default: 0.99 for Lion (the paper's), 0.999 for the others",
    )
    came_beta3: float = option(0.9999, help="CAME's third beta: the decay of its instability statistics (the momentum's deviation from each update)")
    adam_epsilon: float = option(1e-8, help="AdamW's epsilon, added to the root of the second moment (keeps tiny moments from blowing up the step)")
    weight_decay: float = option(1e-2, help="decoupled weight decay of every optimizer")
    prodigy_d_coef: float = option(1.0, help="prodigy: factor on every estimate of the step size (0.5-2; Prodigy's preferred knob)")
    prodigy_d0: float = option(1e-6, help="prodigy: the first estimate of the step size (rarely needs changing)")
    prodigy_growth_rate: float | None = option(None, help="prodigy: the most the step size may grow per update, a factor such as 1.02; None = unbounded")
    prodigy_use_bias_correction: bool = option(False, help="prodigy: Adam's bias correction in the step size")
    prodigy_safeguard_warmup: bool = option(
        False, help="prodigy: leave the learning rate out of the estimate's denominator (its authors' advice with a warm-up)"
    )

    def problems(self) -> list[str]:
        problems = []
        for name in ("learning_rate", "adam_epsilon", "prodigy_d_coef", "prodigy_d0"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            problems.append(f"--weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2", "came_beta3"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                problems.append(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.prodigy_growth_rate is not None and not self.prodigy_growth_rate >= 1:
            problems.append(f"--prodigy_growth_rate is a factor of at least 1 (None = unbounded), got {self.prodigy_growth_rate}")
        if self.optimizer == "prodigy" and self.learning_rate < PRODIGY_MIN_LEARNING_RATE:
            problems.append(
                f"--optimizer prodigy estimates its own step size and --learning_rate multiplies it: pass --learning_rate 1.0 "
                f"(0.5-2 to tune; --prodigy_d_coef is its preferred knob), got {self.learning_rate}"
            )
        if self.optimizer == "adamw_schedulefree" and self.adam_beta1 == 0:
            problems.append("--optimizer adamw_schedulefree needs --adam_beta1 > 0: its evaluated weights are (y - (1 - beta1) z) / beta1")
        return problems

    def prodigy_settings(self) -> ProdigySettings:
        return ProdigySettings(
            self.prodigy_d0, self.prodigy_d_coef, math.inf if self.prodigy_growth_rate is None else self.prodigy_growth_rate,
            self.prodigy_use_bias_correction, self.prodigy_safeguard_warmup,
        )


def build_optimizer(
    name: str, parameters: Iterable[torch.nn.Parameter] | list[dict], learning_rate: float, weight_decay: float, betas: tuple[float, float | None], eps: float,
    came_beta3: float = 0.9999, prodigy: ProdigySettings = ProdigySettings(),
) -> torch.optim.Optimizer:
    """`parameters`: parameters, or param groups (dicts with their own "lr"). betas and eps apply to the
    AdamW variants, Prodigy and schedule-free AdamW; Lion uses betas; CAME uses betas and came_beta3 (its
    epsilons are the paper's); Adafactor uses neither. A beta2 of None takes the optimizer's default
    (DEFAULT_BETA2). `prodigy`: Prodigy's own settings. Every optimizer here takes the update's verdict on the
    device (StepsIfFinite), also with fp16's loss scaling (TrainStep)."""
    parameters = list(parameters)
    betas = (betas[0], DEFAULT_BETA2.get(name, 0.999) if betas[1] is None else betas[1])
    if name == "adamw8bit":
        from sdxl_trainer.optimizers.adamw8bit import AdamW8bit

        return AdamW8bit(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        if any(parameter.dtype == torch.bfloat16 for parameter in _all_parameters(parameters)):
            from sdxl_trainer.optimizers.adamw8bit import AdamWFp32Moments

            return AdamWFp32Moments(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
        return ShardAdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adafactor":
        return Adafactor(parameters, lr=learning_rate, weight_decay=weight_decay)
    if name == "lion":
        return Lion(parameters, lr=learning_rate, betas=betas, weight_decay=weight_decay)
    if name == "came":
        return CAME(parameters, lr=learning_rate, betas=(*betas, came_beta3), weight_decay=weight_decay)
    if name == "prodigy":
        return Prodigy(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, settings=prodigy)
    if name == "adamw_schedulefree":
        return ScheduleFreeAdamW(parameters, lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {OPTIMIZERS}")


def _all_parameters(parameters: list) -> list[torch.Tensor]:
    return [parameter for entry in parameters for parameter in (entry["params"] if isinstance(entry, dict) else [entry])]


def evaluation_weights_of(optimizer: torch.optim.Optimizer) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
    """How to get the weights to evaluate and export from an optimizer that trains other weights than those
    (schedule-free AdamW: ScheduleFreeAdamW.evaluation_weights); None where they are the trained weights."""
    return optimizer.evaluation_weights if isinstance(optimizer, ScheduleFreeAdamW) else None


def local_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank stores (its shards; torchao's 8-bit state counted as stored; a tensor
    that several parameters' states share, such as Prodigy's step size, once)."""
    total, seen = 0, set()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                local = local_shard(value)
                total += _stored_bytes(local)
    return total


def _stored_bytes(tensor: torch.Tensor) -> int:
    # torchao's quantized state is a tensor subclass whose real storage is its inner tensors (codes + scales).
    inner_names = getattr(tensor, "__tensor_flatten__", None)
    if inner_names is not None and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
