"""What every optimizer here shares: stepping each rank's local shards (not DTensors) in runs of many
tensors, their fp32 state, and the sums over shards that a factored optimizer needs.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from sdxl_trainer.distributed.local_shard import local_shard

# Flatten many tensors into one and write one back into many, each in one call (torch's C++ helpers that
# DDP's bucketing uses): a Python loop of reshapes, splits and views over SDXL's 1,680 tensors took most of
# the 8-bit step's host time (benchmarks/bench_optimizer_step.py --sdxl_tensor_count).
flatten_tensors = torch._C._nn.flatten_dense_tensors
unflatten_tensors = torch._C._nn.unflatten_dense_tensors


def host_values_to(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Numbers from the host as a tensor on `device`, copied without a wait: torch.tensor(values, device=...)
    on a GPU makes a blocking copy, after which the host waits for the device's whole queue. From host memory
    to the device, non_blocking=True is safe: the values are staged before the call returns."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class ParameterSubset(NamedTuple):
    """Some of an optimizer's parameters, stepped on their own (StepsIfFinite.step_subset): the optimizer in
    backward steps each unit's parameters once their gradients are final (training/in_backward.py).
    `groups`: for each param group holding any of them, the group's number and its members as (number over all
    groups, the parameter), in the group's order, so each keeps the number (the stream of its or its chunk's
    rounding) it has in a whole step. `number` tells the subsets apart; `first_chunk` is where the numbers of this
    subset's chunks start in an optimizer that numbers its chunks within an update (8-bit AdamW's rounding
    key): the subsets' ranges do not overlap, as a chunk holds at least one parameter."""

    number: int
    groups: tuple[tuple[int, tuple[tuple[int, torch.Tensor], ...]], ...]
    first_chunk: int


class StepsIfFinite:
    """Marks an optimizer whose step takes the update's verdict on the device (TrainStep): step(finite=...)
    leaves weights, moments and step counts exactly as they were where `finite` (a bool scalar on the
    training device) is False, so the host never waits to learn it. It goes through step() itself, so
    torch's optimizer step hooks still run.

    step_subset steps only some parameters (the optimizer in backward): every optimizer whose step treats each
    parameter on its own, or sums only over one parameter's shards, gives those parameters what a whole step
    would (where their rounding can differ: training/in_backward.py). One whose step needs every parameter first (Prodigy's step-size sums, schedule-free
    AdamW's averaging scalars shared by all) sets `steps_in_parts` to the reason it cannot."""

    steps_in_parts: str | None = None  # None: step_subset works; else why it cannot
    _subset: ParameterSubset | None = None  # set while step_subset steps

    def subsets(self, parts: list[list[torch.Tensor]]) -> list[ParameterSubset]:
        """A ParameterSubset for each list of this optimizer's parameters in `parts` (disjoint lists)."""
        place = {param: (group_number, index) for group_number, members in _numbered_groups(self) for index, param in members}
        subsets, first_chunk = [], 0
        for number, part in enumerate(parts):
            by_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
            for param in part:
                group_number, index = place[param]
                by_group.setdefault(group_number, []).append((index, param))
            groups = tuple((group_number, tuple(sorted(members, key=lambda member: member[0]))) for group_number, members in sorted(by_group.items()))
            subsets.append(ParameterSubset(number, groups, first_chunk))
            first_chunk += len(part)
        return subsets

    def step_subset(self, subset: ParameterSubset, finite: torch.Tensor | None = None) -> None:
        """step(finite=...) over the subset's parameters that have a gradient, and no others."""
        if self.steps_in_parts is not None:
            raise ValueError(f"{type(self).__name__} cannot step some parameters on their own: {self.steps_in_parts}")
        self._subset = subset
        try:
            self.step(finite=finite)
        finally:
            self._subset = None


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


class _Entry(NamedTuple):
    """One parameter with a gradient: its number over all groups (the stream of the stochastic rounding of the
    tensor, or of the chunk it starts), the parameter, and the local shards of its weights, its gradient and
    its state."""

    index: int
    param: torch.Tensor
    weights: torch.Tensor
    grad: torch.Tensor
    state: dict


def _entries_per_group(optimizer: torch.optim.Optimizer, new_state) -> Iterable[tuple[dict, list[_Entry]]]:
    """Each param group with its parameters that have a gradient; `new_state(param)` fills an empty state.
    While step_subset steps, only the subset's parameters, with the numbers they have in a whole step."""
    subset = getattr(optimizer, "_subset", None)
    for group_number, members in _numbered_groups(optimizer) if subset is None else subset.groups:
        entries = []
        for index, param in members:
            if param.grad is not None:
                state = optimizer.state[param]
                if not state:
                    state.update(new_state(param))
                entries.append(_Entry(index, param, local_shard(param), local_shard(param.grad), state))
        if entries:
            yield optimizer.param_groups[group_number], entries


def _numbered_groups(optimizer: torch.optim.Optimizer) -> list[tuple[int, list[tuple[int, torch.Tensor]]]]:
    """Each param group's number and its parameters as (number over all groups, parameter): the number keys a
    parameter's stream of stochastic rounding (or its chunk's), in a whole step and in a subset alike."""
    numbered, first = [], 0
    for group_number, group in enumerate(optimizer.param_groups):
        numbered.append((group_number, list(enumerate(group["params"], start=first))))
        first += len(group["params"])
    return numbered


def start_factored_step(entries: list[_Entry], finite: torch.Tensor | None) -> tuple[tuple[dist.ProcessGroup, ...], torch.Tensor, dict[int, torch.Tensor]]:
    """How a factored optimizer's step over one param group's `entries` starts: the process groups their rows are
    split over (one for the whole group), the update's verdict on their device (True where `finite` is None),
    their gradients zeroed where it is False, and each entry's update count on the device (device_step_counts)."""
    shard_groups = {_row_shard_groups(entry.param) for entry in entries}
    if len(shard_groups) > 1:
        raise ValueError("a param group mixes parameters sharded over different process groups: give each its own group")
    device = entries[0].weights.device
    verdict = torch.ones((), dtype=torch.bool, device=device) if finite is None else finite.to(device)
    if finite is not None:
        zero_where_not_finite([entry.grad for entry in entries], verdict)
    return shard_groups.pop(), verdict, device_step_counts(entries, verdict)


# Values per run of zero_where_not_finite: its temporaries are two copies of the run's gradients.
ZERO_RUN_VALUES = 1 << 24


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


def entries_by_kind(entries: list[_Entry]) -> Iterable[list[_Entry]]:
    """The entries that can be flattened together: one dtype of weights and of gradients and one device each."""
    by_kind: dict[tuple, list[_Entry]] = {}
    for entry in entries:
        by_kind.setdefault((entry.weights.dtype, entry.grad.dtype, entry.weights.device), []).append(entry)
    return by_kind.values()


def runs_by_kind(entries: list[_Entry], max_values: int) -> Iterable[list[_Entry]]:
    """Runs of entries to flatten together (entries_by_kind), at most max_values values (a larger shard alone)."""
    for kind_entries in entries_by_kind(entries):
        yield from runs_of_at_most(kind_entries, [entry.weights.numel() for entry in kind_entries], max_values)


def device_step_counts(entries: list[_Entry], verdict: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each entry's step count (by its index) after adding this update's verdict (1 where it steps, 0 where it
    is skipped), on the device, for the entries whose state keeps one: no value is read on the host."""
    counts = [entry.state["step"] for entry in entries if "step" in entry.state]
    if counts:
        torch._foreach_add_(counts, verdict.to(counts[0].dtype))
    return {entry.index: entry.state["step"] for entry in entries if "step" in entry.state}


def zero_where_not_finite(grads: list[torch.Tensor], verdict: torch.Tensor) -> None:
    """The gradients set to zero, in place, where the update's verdict (a bool scalar on their device) is False:
    an optimizer that keeps its state by giving the new values a weight of 0 needs finite values to weigh.
    In flat runs of one dtype, one selection each."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        for run in runs_of_at_most(same_dtype, [grad.numel() for grad in same_dtype], ZERO_RUN_VALUES):
            flat = torch._C._nn.flatten_dense_tensors(run)
            torch._foreach_copy_(run, torch._C._nn.unflatten_dense_tensors(torch.where(verdict, flat, 0.0), run))


def one_tensor_in_every_state(states: list[dict], key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The tensor that every state in `states` holds under `key`, one object for all: scalars an optimizer keeps
    for a whole group or for all its parameters (Prodigy's step-size estimate, schedule-free AdamW's averaging
    weights). Being per-parameter state, they are saved and restored through DCP with the rest (which leaves
    param_groups out: state/save.py), and one operation updates them for every parameter. The first state's
    (make() when none has one) is given to every state that holds another or none: a state loaded by torch's
    load_state_dict gives each parameter its own copy, all equal."""
    shared = next((state[key] for state in states if key in state), None)
    if shared is None:
        shared = make()
    for state in states:
        if state.get(key) is not shared:
            state[key] = shared
    return shared


def shard_groups_of(entries: list[_Entry]) -> tuple[dist.ProcessGroup, ...]:
    """The process groups over which the entries' rows are split (_row_shard_groups), the same for all of them."""
    groups = {_row_shard_groups(entry.param) for entry in entries}
    if len(groups) > 1:
        raise ValueError("the parameters are sharded over different process groups: give each layout an optimizer of its own")
    return groups.pop() if groups else ()


def sum_over_all_shards(values: torch.Tensor, entries: list[_Entry]) -> torch.Tensor:
    """`values` (this rank's sums over its shards of `entries`) summed over every rank that holds other rows, on
    the device of the collective (with --cpu_offload the shards are in host memory, NCCL reduces on the GPU)."""
    groups = shard_groups_of(entries)
    if not groups:
        return values
    mesh_device = entries[0].param.device_mesh.device_type
    return _sum_over_shards(values.to(mesh_device), groups).to(values.device)


def fp32_zeros_like(param: torch.Tensor) -> torch.Tensor:
    """fp32 zeros laid out as `param` (sharded alike), made from its local shard: DTensor's zeros_like would
    work out its sharding first, as each DTensor op does (see ShardAdamW). Every optimizer's new state."""
    zeros = torch.zeros_like(local_shard(param), dtype=torch.float32)
    if isinstance(param, DTensor):
        zeros = DTensor.from_local(zeros, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return zeros


def factored_zeros(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 zeros for a factored statistic of a weight of 2 or more dims, factored over (dim 0, all other dims
    flattened): one value per row, laid out as the weight's dim 0 (so sharded alike), and one per column,
    whole on every rank (they are few, and every row adds to each)."""
    local = local_shard(param)
    rows = torch.zeros(local.shape[0], dtype=torch.float32, device=local.device)
    columns = torch.zeros(local[:1].flatten(1).shape[1], dtype=torch.float32, device=local.device)
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        rows = DTensor.from_local(rows, mesh, param.placements, shape=param.shape[:1], stride=(1,))
        columns = DTensor.from_local(columns, mesh, [Replicate()] * mesh.ndim)
    return rows, columns


# Values per run of same-shaped tensors that a factored optimizer steps at once: its temporaries are a few fp32
# copies of the run (64 MB each at most; a larger tensor is a run of its own).
FACTORED_RUN_VALUES = 1 << 24


class StackedRun:
    """Entries whose local shards share one shape (and their parameters one whole shape), dtypes and device,
    stepped at once: each tensor they need stacked along a new first dim, so an operator costs one dispatch
    for the run, where a step tensor by tensor cost one per tensor (SDXL's UNet has 1,680 tensors in 44
    shapes). What a factored optimizer computes per tensor (a row mean, a sum of squares) it computes along
    the stacked dims, each tensor's on its own."""

    def __init__(self, entries: list[_Entry]):
        self.entries = entries
        param = entries[0].param
        self.factored = param.ndim >= 2  # factored over (dim 0, all other dims flattened)
        self.row_count = param.shape[0] if param.ndim else 1  # the whole tensor's rows, every shard's
        self.numel = param.numel()  # the whole tensor's values

    def __len__(self) -> int:
        return len(self.entries)

    def grads(self) -> torch.Tensor:
        return torch.stack([entry.grad for entry in self.entries]).float()

    def weights(self) -> torch.Tensor:
        return torch.stack([entry.weights for entry in self.entries]).float()

    def state(self, key: str) -> torch.Tensor:
        return torch.stack([local_shard(entry.state[key]) for entry in self.entries])

    def store(self, key: str, stacked: torch.Tensor) -> torch.Tensor:
        """Writes `stacked` (the run's state `key`, as state() stacks it) back into each entry's; returns it."""
        torch._foreach_copy_([local_shard(entry.state[key]) for entry in self.entries], stacked.unbind(0))
        return stacked

    @staticmethod
    def per_tensor(values: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
        """`values` (one per tensor of the run, or one for all) shaped to broadcast over `stacked`."""
        return values.view(-1, *[1] * (stacked.ndim - 1))

    def sums_of_squares(self, stacked: torch.Tensor) -> torch.Tensor:
        """Each tensor's sum of squares of `stacked` (one per tensor of the run)."""
        return stacked.view(len(self.entries), -1).square().sum(1)

    def clip_divisors(self, sums_of_squares: torch.Tensor, clip_threshold: float) -> torch.Tensor:
        """What divides each tensor's update so its RMS (`sums_of_squares` over every shard, one per tensor) is at
        most clip_threshold: 1 where it already is."""
        return (sums_of_squares.sqrt() / math.sqrt(self.numel) / clip_threshold).clamp(min=1.0)


def stacked_runs(entries: list[_Entry]) -> list[StackedRun]:
    """The entries in StackedRuns of at most FACTORED_RUN_VALUES values (a larger shard alone)."""
    by_shape: dict[tuple, list[_Entry]] = {}
    for entry in entries:
        kind = (entry.param.shape, entry.weights.shape, entry.weights.dtype, entry.grad.dtype, entry.weights.device)
        by_shape.setdefault(kind, []).append(entry)
    runs = []
    for same_shape in by_shape.values():
        runs += [StackedRun(run) for run in runs_of_at_most(same_shape, [entry.weights.numel() for entry in same_shape], FACTORED_RUN_VALUES)]
    return runs


class FactoredScales(NamedTuple):
    """What divides a run's values by the root of their factored statistic (rows x columns / the mean row): the
    inverse roots of each tensor's rows over its mean row (tensors x local rows x 1) and of its columns
    (tensors x 1 x columns), worked out once per update for every use."""

    rows: torch.Tensor
    columns: torch.Tensor


def normalised(values: torch.Tensor, scales: torch.Tensor | FactoredScales) -> torch.Tensor:
    """`values` (a run's stacked local shards) over the root of their statistic: `scales` is its inverse root,
    whole or factored (finish_statistics)."""
    if isinstance(scales, FactoredScales):
        return (values.flatten(2) * scales.rows * scales.columns).view_as(values)
    return values * scales


def updates_and_clip_divisors(
    runs: list[StackedRun], moment_scales: list[torch.Tensor | FactoredScales], shard_group: tuple, clip_threshold: float,
) -> Iterator[tuple[StackedRun, torch.Tensor, torch.Tensor]]:
    """Each run with its update (its gradients over the root of their second moments, normalised()) and what
    divides each tensor's update so that its RMS over every shard is at most clip_threshold (clip_divisors).
    Sharded, each tensor's sum of squares needs every shard's: all runs' are summed in one all-reduce before any
    update is clipped, so an update is computed twice (for its squares, then to be applied) and one run's is held
    at a time. Whole tensors (one process) need no other rank: each run's update is computed once."""
    if not shard_group:
        for run, scales in zip(runs, moment_scales):
            update = normalised(run.grads(), scales)
            yield run, update, run.clip_divisors(run.sums_of_squares(update), clip_threshold)
        return
    squares = torch.cat([run.sums_of_squares(normalised(run.grads(), scales)) for run, scales in zip(runs, moment_scales)])
    for run, scales, run_squares in zip(runs, moment_scales, _sum_over_shards(squares, shard_group).split([len(run) for run in runs])):
        yield run, normalised(run.grads(), scales), run.clip_divisors(run_squares, clip_threshold)


def move_statistic(run: StackedRun, name: str, values: torch.Tensor, weight_of_new: torch.Tensor, sums: list[torch.Tensor]) -> torch.Tensor:
    """Moves the run's statistic `name` towards `values` (stacked fp32), the new weighed by `weight_of_new` (one
    per tensor, or one for all). An unfactored one (state `name`) moves whole and is returned. Of a factored
    one, the rows (`name`_row, local) move towards the row means of `values` and are returned; what its columns
    and mean row need from every row (the column sums of `values`, the sum of the rows) is appended to `sums`,
    for finish_statistics."""
    if not run.factored:
        return run.store(name, run.state(name).lerp_(values, run.per_tensor(weight_of_new, values)))
    flat = values.flatten(2)
    row_means = flat.mean(2)
    rows = run.store(f"{name}_row", run.state(f"{name}_row").lerp_(row_means, run.per_tensor(weight_of_new, row_means)))
    sums += [flat.sum(1).flatten(), rows.sum(1)]
    return rows


def finish_statistics(
    runs: list[StackedRun], moved: list[torch.Tensor | None], sums: list[torch.Tensor], shard_group: tuple, name: str, weights_of_new: list[torch.Tensor],
) -> list[torch.Tensor | FactoredScales | None]:
    """move_statistic's `sums` (of every factored run, in order) summed over the shards in one all-reduce, then
    each factored run's columns (`name`_col) moved towards the column means. Returns the inverse root of each
    run's statistic, for normalised(): whole for an unfactored run, FactoredScales for a factored one (None
    where move_statistic was not called)."""
    summed = iter(_sum_over_shards(torch.cat(sums), shard_group).split([part.numel() for part in sums])) if sums else iter(())
    scales = []
    for run, statistic, weight_of_new in zip(runs, moved, weights_of_new):
        if statistic is not None and run.factored:
            column_means = next(summed).view(len(run), -1) / run.row_count
            columns = run.store(f"{name}_col", run.state(f"{name}_col").lerp_(column_means, run.per_tensor(weight_of_new, column_means)))
            row_mean = next(summed) / run.row_count
            statistic = FactoredScales((statistic / row_mean.unsqueeze(1)).rsqrt_().unsqueeze(2), columns.rsqrt().unsqueeze(1))
        elif statistic is not None:
            statistic = statistic.rsqrt()
        scales.append(statistic)
    return scales
