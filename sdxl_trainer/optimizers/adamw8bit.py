"""8-bit AdamW that steps many parameter tensors per kernel.

torchao's AdamW8bit keeps Adam's two moments in 8 bits (dynamic-tree codes, one fp32 scale per 256
values), steps DTensor shards and saves through DCP (docs/design.md §2), but its step runs one compiled
call per parameter tensor, several times the host work per tensor of a multi-tensor step (measured on a
CPU: docs/design.md §2), and SDXL's UNet has 1,680 tensors on every rank however many ranks share it. It also compiles one kernel per distinct shape, which made the
quickstart's first update wait minutes.

`AdamW8bit` keeps torchao's state objects and checkpoint layout as they are (a checkpoint written by either
resumes on the other, and DCP reshards it the same way) and replaces only the step: each rank's local
shards are concatenated into flat chunks of up to CHUNK_VALUES values, one compiled kernel with dynamic
shapes (compiled once, not per shape) updates a chunk, and multi-tensor copies write the weights back. A
chunk's state lives in flat buffers that the shards' state tensors are views into, so it is read and
written whole, with no per-tensor work.
The arithmetic and the rounding to codes are torchao's, so both give the same weights and scales to fp32
rounding; a value that rounding puts on the other side of a code boundary gets the neighbouring code
(tests/optimizers/test_adamw8bit.py allows 0.01% of the codes to differ).

bf16 weights (--weights_dtype bf16): the step computes in fp32 as always and rounds the new weights
stochastically (stochastic_rounding.py), where torchao rounds to nearest, which drops every update below
half a bf16 step; moments kept unquantised (small shards) stay fp32 rather than taking the weights' dtype.
AdamWFp32Moments is the same step with every moment in fp32: --optimizer adamw over bf16 weights.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import NamedTuple

import torch
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torch.distributed.tensor import DTensor
from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import StepsIfFinite, flatten_tensors, fp32_zeros_like, runs_of_at_most
from sdxl_trainer.optimizers.stochastic_rounding import rounding_keys, runs_compiled, store_run

# Values per chunk: the kernel's temporaries are about 16 bytes per value (270 MB at this size) and a
# larger chunk saves little host time, as SDXL's UNet makes about 150 chunks on one GPU. A larger shard is a
# chunk of its own: SDXL's largest tensors (up_blocks.0.resnets.{0,1}.conv1, 29.5 M values) make one of
# 470 MB of temporaries on one GPU, half that on two.
CHUNK_VALUES = 1 << 24
# Values per quantisation block: torchao's default, which this optimizer always uses. A constant, so the
# kernel compiled with dynamic chunk lengths still divides by a number known when it is compiled.
BLOCK_SIZE = 256


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, code_values: torch.Tensor) -> torch.Tensor:
    return (code_values[codes.int()].view(-1, BLOCK_SIZE) * scale[:, None]).view(-1)


def _quantize(values: torch.Tensor, code_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's blockwise quantisation: scale each block to an absolute maximum of 1, then round to the
    nearest of the 256 sorted code values (a branchless binary search, then a step up past the midpoint)."""
    blocks = values.view(-1, BLOCK_SIZE)
    scale = blocks.abs().amax(-1).clip(1e-12)
    normalized = (blocks / scale[:, None]).view(-1)
    below = torch.where(normalized >= code_values[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        below = below + torch.where(normalized >= code_values[below + step], step, 0)
    above = (below + 1).clip(max=255)
    value_below, value_above = code_values[below], code_values[above]
    codes = torch.where(normalized - value_below >= (value_above - value_below) * 0.5, above, below)
    return codes.to(torch.uint8), scale


def _adamw_update(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step):
    """One AdamW update in fp32, written as torchao's single_param_adam is (same order of operations)."""
    param = param.float()
    grad = grad.float()
    param = param - lr * weight_decay * param
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.lerp(grad.square(), 1 - beta2)
    denominator = (exp_avg_sq.sqrt() / (1 - beta2**step).sqrt()) + eps
    param = param - lr * (exp_avg / (1 - beta1**step)) / denominator
    return param, exp_avg, exp_avg_sq


# Each kernel writes the chunk's new state into its state buffers in place (inside the kernel: no copies
# launched after it) and returns the new weights, leaving everything unchanged where `finite` (the update's
# verdict, a bool scalar on the device) is False: the selection is fused into the kernel, which reads and
# writes every value anyway. Unchanged bf16 weights come back as their exact fp32 values, which stochastic
# rounding leaves as they are.
def _adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step, finite):
    new_param, new_avg, new_avg_sq = _adamw_update(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step)
    exp_avg.copy_(torch.where(finite, new_avg, exp_avg))
    exp_avg_sq.copy_(torch.where(finite, new_avg_sq, exp_avg_sq))
    return torch.where(finite, new_param, param.float())


def _step_8bit_moments(param, grad, avg_codes, avg_scale, sq_codes, sq_scale, signed_values, unsigned_values, lr, beta1, beta2, weight_decay, eps, step,
                       finite):
    exp_avg = _dequantize(avg_codes, avg_scale, signed_values)
    exp_avg_sq = _dequantize(sq_codes, sq_scale, unsigned_values)
    new_param, exp_avg, exp_avg_sq = _adamw_update(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step)
    new_states = (*_quantize(exp_avg, signed_values), *_quantize(exp_avg_sq, unsigned_values))
    for state, new in zip((avg_codes, avg_scale, sq_codes, sq_scale), new_states):
        state.copy_(torch.where(finite, new, state))
    return torch.where(finite, new_param, param.float())


# Compiled once each with dynamic shapes: every chunk, whatever its length, runs the same kernel.
_compiled_step_8bit_moments = torch.compile(_step_8bit_moments, dynamic=True, fullgraph=True)
_compiled_adamw = torch.compile(_adamw, dynamic=True, fullgraph=True)




def _views_of_one_buffer(buffer: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Tensors of these shapes laid end to end in the flat `buffer`, each a view into it."""
    views, offset = [], 0
    for shape in shapes:
        views.append(buffer[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return views


def _wraps_in_place(param: torch.Tensor) -> bool:
    """Whether a state tensor made for `param`'s local shard is still that tensor once sharded as `param` is: not
    under CPU offload, where DTensor.from_local copies a host tensor to the mesh's device (and torchao's
    _new_buffer copies it back), so it would no longer view its chunk's buffer."""
    return not isinstance(param, DTensor) or param.device_mesh.device_type == local_shard(param).device.type


def _shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a state tensor for `param`'s local shard, _wraps_in_place) as the state torchao makes for
    `param`: a DTensor sharded as it is where it is one."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def _share_one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding the values of `tensors`, each of which becomes a view into it (`set_`: the same
    tensor objects, so the optimizer's state, its checkpoints and a resume see them as before). A step then
    reads and writes the buffer in one call, where flattening the state and writing it back cost a call per
    tensor and direction. A save copies each view into a buffer of its own (TensorStager), so a checkpoint
    holds each tensor's values only, not the shared buffer."""
    flat = flatten_tensors(tensors)
    storage, offset = flat.untyped_storage(), 0
    for tensor in tensors:
        tensor.set_(storage, offset, tensor.shape)
        offset += tensor.numel()
    return flat


class _Chunk(NamedTuple):
    """Shards stepped by one kernel call: their parameters (to read the gradients), local weights, and state
    buffers that their state tensors are views into (_share_one_buffer; 8-bit: codes and scales of both
    moments, with the two code tables; otherwise the fp32 moments)."""

    params: list[torch.Tensor]
    weights: list[torch.Tensor]
    states: tuple[torch.Tensor, ...]
    code_values: tuple[torch.Tensor, ...]


class _Batch(NamedTuple):
    """Shards of one kind that step together: same update count, state kind, device and dtypes."""

    step_counts: torch.Tensor  # every shard's count in one tensor on their device, whose elements are their state["step"]: one add a step, not 1,680
    is_8bit: bool
    chunks: list[_Chunk]


class _Layout(NamedTuple):
    """A param group's shards arranged for stepping, kept while the same parameters have gradients and their
    local weights and moments are the same objects (a state loaded with load_state_dict, or weights FSDP
    re-allocated, make a new one): building it reads every tensor's state; using it, only its lists."""

    params: tuple[torch.Tensor, ...]
    weights: tuple[torch.Tensor, ...]
    moments: tuple[torch.Tensor, ...]  # every shard's exp_avg, to see a replaced state
    batches: list[_Batch]


class AdamW8bit(StepsIfFinite, TorchaoAdamW8bit):
    """torchao's AdamW8bit (its state, checkpoints and the fp32 state it keeps for shards under 4,096 values
    or not a multiple of the 256-value block) with a multi-tensor step, stochastic rounding into bf16
    weights, and an update's skip decided on the device (step(finite=...), StepsIfFinite). No amsgrad.
    step_subset (the optimizer in backward) keeps a layout per subset, its chunks numbered from the subset's
    first_chunk: the same weights and state as a whole step with fp32 weights; over bf16 weights other
    rounding bits, as the chunks' numbers key them."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=BLOCK_SIZE)
        self._layouts: dict[tuple[int, int | None], _Layout] = {}  # by (param group, ParameterSubset number or None)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        # torchao gives an unquantised moment the weights' dtype; a bf16 moment would stall as bf16 weights do.
        buffer = super()._new_buffer(p, signed)
        if isinstance(local_shard(buffer), OptimState8bit) or buffer.dtype == torch.float32:
            return buffer
        return buffer.float()

    def _quantizes(self, local: torch.Tensor) -> bool:
        """Whether a local shard's moments are 8-bit: torchao's rule in _new_buffer (as bitsandbytes, shards of
        4,096 values or more, in whole blocks)."""
        return local.numel() >= 4096 and local.numel() % self.block_size == 0

    def _new_states_in_flat_buffers(self, params: list[torch.Tensor], is_8bit: bool) -> tuple[torch.Tensor, ...]:
        """Zero state for `params` (which have none yet) made as flat buffers, one per kind of state tensor (8-bit:
        codes and scales of each moment; otherwise each fp32 moment), that the parameters' state tensors view:
        the state torchao's _new_buffer makes, laid out as a chunk steps it. Made one tensor at a time and then
        copied into a chunk's buffers (_share_one_buffer), the state would be allocated twice over on the first
        update, and a memory tracker that does not see set_'s release counts both."""
        locals_ = [local_shard(param) for param in params]
        shapes = [local.shape for local in locals_]
        device = locals_[0].device
        total = sum(shape.numel() for shape in shapes)
        moments = []  # per moment: its flat buffers, and each parameter's state tensor viewing them
        for signed, code_values in ((True, get_qmap_signed()), (False, get_qmap_unsigned())):
            if is_8bit:
                codes = torch.zeros(total, dtype=torch.uint8, device=device)
                scales = torch.zeros(total // self.block_size, dtype=torch.float32, device=device)
                qmap = torch.tensor(code_values, dtype=torch.float32, device=device)
                scale_shapes = [torch.Size([shape.numel() // self.block_size]) for shape in shapes]
                states = [
                    OptimState8bit(code, scale, qmap, signed, dtype=local.dtype)  # torchao's state: its dtype the weights'
                    for code, scale, local in zip(_views_of_one_buffer(codes, shapes), _views_of_one_buffer(scales, scale_shapes), locals_)
                ]
                moments.append(((codes, scales), states))
            else:
                flat = torch.zeros(total, dtype=torch.float32, device=device)
                moments.append(((flat,), _views_of_one_buffer(flat, shapes)))
        (avg_buffers, exp_avgs), (sq_buffers, exp_avg_sqs) = moments
        for param, exp_avg, exp_avg_sq in zip(params, exp_avgs, exp_avg_sqs):
            self.state[param].update(exp_avg=_shaped_like(param, exp_avg), exp_avg_sq=_shaped_like(param, exp_avg_sq))
        return (*avg_buffers, *sq_buffers)

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone (weights, moments, step counts) where `finite` (a bool scalar on the device) is
        False; None: always. Nothing here reads a value from the device."""
        subset = self._subset  # step_subset: only these parameters, their chunks numbered from the subset's first_chunk
        chunks_stepped = 0 if subset is None else subset.first_chunk
        candidates = (
            [(number, group["params"]) for number, group in enumerate(self.param_groups)] if subset is None
            else [(number, [param for _, param in members]) for number, members in subset.groups]
        )  # fmt: skip
        for group_number, group_params in candidates:
            group = self.param_groups[group_number]
            layout = self._layout((group_number, None if subset is None else subset.number), group_params)
            if layout is None:
                continue
            for batch in layout.batches:
                device = batch.step_counts.device
                batch_finite = torch.ones((), dtype=torch.bool, device=device) if finite is None else finite.to(device)
                batch.step_counts.add_(batch_finite)
                chunks_stepped += self._step_batch(batch, group, chunks_stepped, batch_finite)

    def _layout(self, key: tuple[int, int | None], group_params: list[torch.Tensor]) -> _Layout | None:
        """The layout of a group's parameters `group_params` for this step (None: none has a gradient): the kept
        one while it holds. `key`: the group's number and the ParameterSubset's (None: the whole group)."""
        params = tuple(param for param in group_params if param.grad is not None)
        if not params:
            return None
        kept = self._layouts.get(key)
        if (kept is not None and len(kept.params) == len(params) and all(map(operator.is_, kept.params, params))
                and all(map(operator.is_, kept.weights, map(local_shard, params)))
                and all(map(operator.is_, kept.moments, (self.state[param]["exp_avg"] for param in params)))):
            return kept
        # A whole-group layout and the subsets' share the same state tensors, each set into its own buffers: keep
        # one kind per group, so no buffer left behind holds a second copy of the state.
        group_number, subset_number = key
        for other in [other for other in self._layouts if other[0] == group_number and (other[1] is None) != (subset_number is None)]:
            del self._layouts[other]
        # Shards step together when they share the update count (all of them, unless some had no gradient on
        # some update), the kind of state, the device and the dtypes. A shard without state yet has count 0.
        kinds = defaultdict(list)
        counts = [state["step"] for state in map(self.state.__getitem__, params) if state]
        stored_counts = iter(torch.stack(counts).tolist() if counts else [])
        for param in params:
            state, weights = self.state[param], local_shard(param)
            step = next(stored_counts) if state else 0.0
            if weights.numel() == 0:  # an uneven shard can leave a rank no values of this tensor
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(param, True), exp_avg_sq=self._new_buffer(param, False))
                continue
            is_8bit = isinstance(local_shard(state["exp_avg"]), OptimState8bit) if state else self._quantizes(weights)
            kinds[(step, is_8bit, weights.device, weights.dtype, local_shard(param.grad).dtype)].append((param, weights))
        batches = []
        for (step, is_8bit, _, _, _), shards in kinds.items():
            # One tensor holds the update counts of the batch's shards; each shard's state["step"] is its element
            # (a tensor of its own to load, save and count, as torchao's are).
            step_counts = torch.full((len(shards),), step, device=shards[0][1].device)
            chunks = []
            for run in runs_of_at_most(shards, [weights.numel() for _, weights in shards], CHUNK_VALUES):
                run_params, weights = (list(tensors) for tensors in zip(*run))
                chunks.append(self._chunk(run_params, weights, is_8bit))
            for number, (param, _) in enumerate(shards):
                self.state[param]["step"] = step_counts[number]
            batches.append(_Batch(step_counts, is_8bit, chunks))
        layout = _Layout(params, tuple(map(local_shard, params)), tuple(self.state[param]["exp_avg"] for param in params), batches)
        self._layouts[key] = layout
        return layout

    def _chunk(self, params: list[torch.Tensor], weights: list[torch.Tensor], is_8bit: bool) -> _Chunk:
        """The chunk of these shards, their state in its flat buffers: made there if none of them has state yet
        (and a view stays a view, _wraps_in_place), else copied there (a shard without state gets torchao's first)."""
        if not any(self.state[param] for param in params) and all(map(_wraps_in_place, params)):
            buffers = self._new_states_in_flat_buffers(params, is_8bit)
        else:
            for param in params:
                if not self.state[param]:
                    self.state[param].update(exp_avg=self._new_buffer(param, True), exp_avg_sq=self._new_buffer(param, False))
            exp_avgs = [local_shard(self.state[param]["exp_avg"]) for param in params]
            exp_avg_sqs = [local_shard(self.state[param]["exp_avg_sq"]) for param in params]
            if is_8bit:
                parts = ([state.codes for state in exp_avgs], [state.scale for state in exp_avgs],
                         [state.codes for state in exp_avg_sqs], [state.scale for state in exp_avg_sqs])
            else:
                parts = (exp_avgs, exp_avg_sqs)
            buffers = tuple(map(_share_one_buffer, parts))
        first = self.state[params[0]]
        code_values = (local_shard(first["exp_avg"]).qmap, local_shard(first["exp_avg_sq"]).qmap) if is_8bit else ()
        return _Chunk(params, weights, buffers, code_values)

    def _step_batch(self, batch: _Batch, group: dict, first_chunk: int, finite: torch.Tensor) -> int:
        """Step one batch's chunks where `finite`; returns their number. `first_chunk` numbers them within the
        update, which keys their stochastic rounding."""
        beta1, beta2 = group["betas"]
        step_settings = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"], batch.step_counts[0], finite)
        # torch.compile cannot trace under the memory estimate's fake tensors and trackers (estimates/fake_run.py):
        # the same functions run eagerly there, their temporaries an upper bound.
        eager = not runs_compiled()
        step_8bit_moments = _step_8bit_moments if eager else _compiled_step_8bit_moments
        adamw = _adamw if eager else _compiled_adamw
        keys = None  # bf16 weights: the chunks' keys, rounding_key(step count, chunk number) each, hashed at once
        if batch.chunks[0].weights[0].dtype == torch.bfloat16:  # a batch's shards share their dtype
            numbers = torch.arange(first_chunk, first_chunk + len(batch.chunks), device=batch.step_counts.device)
            keys = rounding_keys(batch.step_counts[0], numbers)
        for number, chunk in enumerate(batch.chunks):
            weights, grads = flatten_tensors(chunk.weights), flatten_tensors([local_shard(param.grad) for param in chunk.params])
            kernel = step_8bit_moments if batch.is_8bit else adamw
            new_weights = kernel(weights, grads, *chunk.states, *chunk.code_values, *step_settings)
            store_run(chunk.weights, new_weights, keys, number)
        return len(batch.chunks)


class AdamWFp32Moments(AdamW8bit):
    """AdamW with both moments in fp32 (torch AdamW's state and checkpoint layout) and AdamW8bit's
    multi-tensor step: --optimizer adamw over bf16 weights, which torch's AdamW would round to nearest."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:  # noqa: ARG002 - moments are never quantised
        return fp32_zeros_like(p)

    def _quantizes(self, local: torch.Tensor) -> bool:  # noqa: ARG002 - moments are never quantised
        return False
