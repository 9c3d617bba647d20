"""Optimizers that step FSDP2's DTensor shards and save through torch.distributed.checkpoint.

Which implementation, and why (each was tried on 2 gloo ranks with FSDP2 parameters):
- adamw8bit: torchao's AdamW8bit state with our multi-tensor step (adamw8bit.py). bitsandbytes' kernels
  have no DTensor sharding rule (`NotImplementedError: ... optimizer_update_32bit ... does not have a
  sharding strategy registered`), while torchao's quantized state lives in DTensor shards and DCP saves
  and reshards it (docs/design.md §2).
- adamw: torch's fused AdamW kernel on each rank's local shards (ShardAdamW), torch AdamW's fp32 state.
- adafactor: our own, below. torch.optim.Adafactor fails on DTensors (an in-place pow_ on a partial
  norm) and transformers' Adafactor mixes plain tensors into DTensor ops.
- lion: our own, below. The only 8-bit Lion (bitsandbytes) has the same missing DTensor rule as its
  AdamW8bit; Lion keeps one momentum buffer, already half of AdamW's fp32 state.
Both step each rank's local shards (FSDP2 splits dim 0) and sum over the shards what needs every row, for
all parameters at once, so a sharded step equals the unsharded one to fp32 rounding.

bf16 weights (--weights_dtype bf16): every optimizer computes its update in fp32 and rounds the new
weights stochastically (stochastic_rounding.py), keyed by its step count; its own state stays fp32 (or
8-bit). torch's AdamW cannot do that, so --optimizer adamw over bf16 weights is AdamWFp32Moments, with
torch AdamW's state layout.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw

from .stochastic_rounding import rounding_key, store_weights

OPTIMIZERS = ("adamw8bit", "adamw", "adafactor", "lion")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _row_shard_groups(param: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups among which `param`'s rows (dim 0) are split: FSDP2's shard dimension of the mesh
    (HSDP's replicas already hold the same rows); none for a plain tensor."""
    if not isinstance(param, DTensor):
        return ()
    groups = []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if not placement.is_shard(0):
                raise ValueError(f"a parameter sharded on dim {placement.dim}: these optimizers step FSDP2's dim-0 shards")
            groups.append(param.device_mesh.get_group(mesh_dim))
    return tuple(groups)


def _sum_over_shards(values: torch.Tensor, groups: tuple[dist.ProcessGroup, ...]) -> torch.Tensor:
    """`values` (each rank's sums over its rows) summed over all rows, in place: one all-reduce per group."""
    for group in groups:
        dist.all_reduce(values, group=group)
    return values


# Values per multi-tensor op: the step's temporaries are a few fp32 copies of the values it updates at once,
# so it updates the parameters in runs of at most this many values (64 MB each in fp32), not all at once.
CHUNK_VALUES = 1 << 24


class _Entry(NamedTuple):
    """One parameter with a gradient: its number over all groups (the stream of its stochastic rounding), the
    parameter, and the local shards of its weights, its gradient and its state."""

    index: int
    param: torch.Tensor
    weights: torch.Tensor
    grad: torch.Tensor
    state: dict


def _entries_per_group(optimizer: torch.optim.Optimizer, new_state) -> Iterable[tuple[dict, list[_Entry]]]:
    """Each param group with its parameters that have a gradient; `new_state(param)` fills an empty state."""
    index = 0
    for group in optimizer.param_groups:
        entries = []
        for param in group["params"]:
            if param.grad is not None:
                state = optimizer.state[param]
                if not state:
                    state.update(new_state(param))
                entries.append(_Entry(index, param, _local(param), _local(param.grad), state))
            index += 1
        if entries:
            yield group, entries


def runs_of_at_most(items: list, sizes: list[int], max_size: int) -> Iterable[list]:
    """Consecutive runs of `items` whose `sizes` add up to at most max_size (a larger item alone); the 8-bit
    AdamW step chunks its shards with it too."""
    run, total = [], 0
    for item, size in zip(items, sizes):
        if run and total + size > max_size:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


def _step_counts(entries: list[_Entry]) -> list[float]:
    """Each entry's step count after adding 1 (0 where its state keeps none), read with one host sync."""
    counts = [entry.state["step"] for entry in entries if "step" in entry.state]
    if not counts:
        return [0.0] * len(entries)
    torch._foreach_add_(counts, 1)
    read = iter(torch.stack(counts).tolist())
    return [next(read) if "step" in entry.state else 0.0 for entry in entries]


def _store_all(entries: list[_Entry], new_values: list[torch.Tensor], steps: list[float]) -> None:
    """The optimizer's fp32 results into the weights: copied into fp32 ones, rounded stochastically into bf16
    ones (keyed by step count and parameter number)."""
    fp32 = [(entry.weights, values) for entry, values in zip(entries, new_values) if entry.weights.dtype == torch.float32]
    if fp32:
        torch._foreach_copy_(*(list(tensors) for tensors in zip(*fp32)))
    for entry, values, step in zip(entries, new_values, steps):
        if entry.weights.dtype != torch.float32:
            store_weights(entry.weights, values, rounding_key(int(step), entry.index))


def fp32_zeros_like(param: torch.Tensor) -> torch.Tensor:
    """fp32 zeros laid out as `param` (sharded alike), made from its local shard: DTensor's zeros_like would
    work out its sharding first, as each DTensor op does (see ShardAdamW). Every optimizer's new state."""
    zeros = torch.zeros_like(_local(param), dtype=torch.float32)
    if isinstance(param, DTensor):
        zeros = DTensor.from_local(zeros, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return zeros


class ShardAdamW(torch.optim.AdamW):
    """torch's fused AdamW (torch.optim.adamw.adamw, fused=True) run on each rank's local shards, with torch
    AdamW's state (step, exp_avg, exp_avg_sq) and so its checkpoints. Called on DTensors, the same kernel
    first works out how each of its arguments is sharded, at a run's first update and again when a resume
    sets up the state: 31.5 s of a CPU core over SDXL's 1,680 tensors, 1.0 s for the tiny UNet's 212
    (benchmarks/bench_optimizer_step.py; 0.55 s and 0.07 s here). AdamW is elementwise, so the local
    shards give the same values bit for bit. No amsgrad, no loss scaling (fp16 steps torch's AdamW)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group, entries in _entries_per_group(self, self._new_state):
            beta1, beta2 = group["betas"]
            adamw(
                [entry.weights for entry in entries], [entry.grad for entry in entries],
                [_local(entry.state["exp_avg"]) for entry in entries], [_local(entry.state["exp_avg_sq"]) for entry in entries],
                [], [entry.state["step"] for entry in entries],
                fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        # The step count as torch's fused AdamW keeps it: a float32 scalar on the parameters' device.
        return {"step": torch.zeros((), dtype=torch.float32, device=_local(param).device), "exp_avg": fp32_zeros_like(param), "exp_avg_sq": fp32_zeros_like(param)}


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
                momenta = [_local(entry.state["exp_avg"]) for entry in chunk]
                weights = torch._foreach_mul([entry.weights.float() for entry in chunk], 1 - group["lr"] * group["weight_decay"])
                directions = torch._foreach_lerp(momenta, grads, 1 - beta1)
                torch._foreach_sign_(directions)
                torch._foreach_add_(weights, directions, alpha=-group["lr"])
                _store_all(chunk, weights, [steps[entry.index] for entry in chunk])
                torch._foreach_lerp_(momenta, grads, 1 - beta2)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with an explicit learning rate, no first moment and update clipping:
    the settings kohya sd-scripts users pass to transformers' Adafactor (relative_step=False,
    scale_parameter=False, warmup_init=False). Second moments of a weight with 2 or more dims are factored
    over (dim 0, all other dims flattened), so a conv kernel keeps one row and one column statistic
    (transformers factors its last two dims, a 3x3 kernel's). A 2-dim and a 1-dim weight get transformers'
    update to fp32 rounding (tests/test_optimizers.py).

    It steps each rank's local shards. FSDP2 splits dim 0, so the row statistics and the elementwise ops are
    local; what needs every row (the column means, the mean of the row statistics, the update's RMS) is
    summed over the shards for all parameters of a group at once: two all-reduces and one host sync per
    update, where DTensor ops made 3,268 all-reduces for SDXL's UNet (three per factored weight, one per
    other parameter) and a host sync per parameter.
    The update is computed twice, before and after its RMS is known, so no more than one parameter's update
    is held at a time."""

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

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        state = {"step": torch.tensor(0.0)}
        if param.ndim < 2:
            state["exp_avg_sq"] = fp32_zeros_like(param)
            return state
        local = _local(param)
        rows = torch.zeros(local.shape[0], dtype=torch.float32, device=local.device)
        columns = torch.zeros(local[:1].flatten(1).shape[1], dtype=torch.float32, device=local.device)
        if isinstance(param, DTensor):  # rows sharded as the weight's, columns whole on every rank (they are few)
            mesh = param.device_mesh
            rows = DTensor.from_local(rows, mesh, param.placements, shape=param.shape[:1], stride=(1,))
            columns = DTensor.from_local(columns, mesh, [Replicate()] * mesh.ndim)
        state["exp_avg_sq_row"], state["exp_avg_sq_col"] = rows, columns
        return state

    @staticmethod
    def _update(entry: _Entry, row_mean: torch.Tensor | None) -> torch.Tensor:
        """The unclipped update from the entry's second-moment state (already this step's); `row_mean`: the
        mean of a factored weight's row statistics over all its rows."""
        grad = entry.grad.float()
        if row_mean is None:
            return grad * _local(entry.state["exp_avg_sq"]).rsqrt()
        rows, columns = _local(entry.state["exp_avg_sq_row"]), _local(entry.state["exp_avg_sq_col"])
        return (grad.flatten(1) * (rows / row_mean).rsqrt()[:, None] * columns.rsqrt()[None, :]).view_as(grad)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group, entries in _entries_per_group(self, self._new_state):
            shard_groups = {_row_shard_groups(entry.param) for entry in entries}
            if len(shard_groups) > 1:
                raise ValueError("a param group mixes parameters sharded over different process groups: give each its own group")
            shard_group = shard_groups.pop()
            steps = _step_counts(entries)
            weights_of_new = [step ** group["decay_rate"] for step in steps]  # 1 - beta2 of this step

            # Rows and unfactored moments are local: update them; sum each factored weight's squared gradient
            # over its columns' local rows, and its new row statistics, then over every shard in one all-reduce.
            sums = []
            for entry, weight_of_new in zip(entries, weights_of_new):
                squared = entry.grad.float().square().add_(group["eps"])
                if "exp_avg_sq" in entry.state:
                    _local(entry.state["exp_avg_sq"]).lerp_(squared, weight_of_new)
                    continue
                flat = squared.flatten(1)
                rows = _local(entry.state["exp_avg_sq_row"])
                rows.lerp_(flat.mean(1), weight_of_new)
                sums += [flat.sum(0), rows.sum().reshape(1)]
            summed = iter(_sum_over_shards(torch.cat(sums), shard_group).split([part.numel() for part in sums])) if sums else iter(())

            # The column statistics and the mean row statistic from the sums; each update's sum of squares.
            squares, row_means = [], []
            for entry, weight_of_new in zip(entries, weights_of_new):
                row_mean = None
                if "exp_avg_sq_col" in entry.state:
                    row_count = entry.param.shape[0]
                    _local(entry.state["exp_avg_sq_col"]).lerp_(next(summed) / row_count, weight_of_new)
                    row_mean = next(summed) / row_count
                row_means.append(row_mean)
                squares.append(self._update(entry, row_mean).square().sum())
            squares = _sum_over_shards(torch.stack(squares), shard_group)
            numels = torch.tensor([float(entry.param.numel()) for entry in entries], device=squares.device)
            clip_divisors = ((squares.sqrt() / numels.sqrt()) / group["clip_threshold"]).clamp(min=1.0)

            for entry, row_mean, clip_divisor, step in zip(entries, row_means, clip_divisors, steps):
                update = self._update(entry, row_mean).div_(clip_divisor).mul_(group["lr"])
                weights = entry.weights.float()
                if group["weight_decay"]:
                    weights = weights * (1 - group["lr"] * group["weight_decay"])
                _store_all([entry], [weights - update], [step])


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
