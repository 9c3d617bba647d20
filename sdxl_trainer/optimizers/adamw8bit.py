"""8-bit AdamW that steps many parameter tensors per kernel.

torchao's AdamW8bit keeps Adam's two moments in 8 bits (dynamic-tree codes, one fp32 scale per 256
values), steps DTensor shards and saves through DCP (docs/design.md §2), but its step runs one compiled
call per parameter tensor: on these CPUs about 250 us of host work each, and SDXL's UNet has 1,680 tensors
on every rank however many ranks share it. It also compiles one kernel per distinct shape, which made the
quickstart's first update wait minutes.

`AdamW8bit` keeps torchao's state objects and checkpoint layout as they are (a checkpoint written by either
resumes on the other, and DCP reshards it the same way) and replaces only the step: each rank's local
shards are concatenated into flat chunks of up to CHUNK_VALUES values, one compiled kernel with dynamic
shapes (compiled once, not per shape) updates a chunk, and multi-tensor copies write the results back.
The arithmetic and the rounding to codes are torchao's, so both give the same weights and scales to fp32
rounding; a value that rounding puts on the other side of a code boundary gets the neighbouring code
(tests/test_adamw8bit.py allows 0.01% of the codes to differ).

bf16 weights (--weights_dtype bf16): the step computes in fp32 as always and rounds the new weights
stochastically (stochastic_rounding.py), where torchao rounds to nearest, which drops every update below
half a bf16 step; moments kept unquantised (small shards) stay fp32 rather than taking the weights' dtype.
AdamWFp32Moments is the same step with every moment in fp32: --optimizer adamw over bf16 weights.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.subclass_8bit import OptimState8bit

from sdxl_trainer.optimizers.shards import fp32_zeros_like, runs_of_at_most
from sdxl_trainer.optimizers.stochastic_rounding import round_to_bf16, rounding_key

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


def _adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step):
    """One AdamW update in fp32, written as torchao's single_param_adam is (same order of operations)."""
    param = param.float()
    grad = grad.float()
    param = param - lr * weight_decay * param
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.lerp(grad.square(), 1 - beta2)
    denominator = (exp_avg_sq.sqrt() / (1 - beta2**step).sqrt()) + eps
    param = param - lr * (exp_avg / (1 - beta1**step)) / denominator
    return param, exp_avg, exp_avg_sq


def _step_8bit_moments(param, grad, avg_codes, avg_scale, sq_codes, sq_scale, signed_values, unsigned_values, lr, beta1, beta2, weight_decay, eps, step):
    exp_avg = _dequantize(avg_codes, avg_scale, signed_values)
    exp_avg_sq = _dequantize(sq_codes, sq_scale, unsigned_values)
    param, exp_avg, exp_avg_sq = _adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, step)
    return (param, *_quantize(exp_avg, signed_values), *_quantize(exp_avg_sq, unsigned_values))


# Compiled once each with dynamic shapes: every chunk, whatever its length, runs the same kernel.
_compiled_step_8bit_moments = torch.compile(_step_8bit_moments, dynamic=True, fullgraph=True)
_compiled_adamw = torch.compile(_adamw, dynamic=True, fullgraph=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Shard(NamedTuple):
    """One parameter's tensors on this rank: the weights, their gradient and Adam's two moments."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor  # OptimState8bit, or fp32 for small shards
    exp_avg_sq: torch.Tensor


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def _write_back(targets: list[torch.Tensor], flat: torch.Tensor) -> None:
    pieces = flat.split([target.numel() for target in targets])
    torch._foreach_copy_(targets, [piece.view(target.shape) for piece, target in zip(pieces, targets)])


class AdamW8bit(TorchaoAdamW8bit):
    """torchao's AdamW8bit (its state, checkpoints and the fp32 state it keeps for shards under 4,096 values
    or not a multiple of the 256-value block) with a multi-tensor step and stochastic rounding into bf16
    weights. No amsgrad."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=BLOCK_SIZE)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        # torchao gives an unquantised moment the weights' dtype; a bf16 moment would stall as bf16 weights do.
        buffer = super()._new_buffer(p, signed)
        if isinstance(_local(buffer), OptimState8bit) or buffer.dtype == torch.float32:
            return buffer
        return buffer.float()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - torch.optim signature
        for group in self.param_groups:
            with_grads = [param for param in group["params"] if param.grad is not None]
            for param in with_grads:
                if not self.state[param]:
                    self.state[param].update(
                        step=torch.tensor(0.0), exp_avg=self._new_buffer(param, True), exp_avg_sq=self._new_buffer(param, False)
                    )
            steps = [self.state[param]["step"] for param in with_grads]
            if not steps:
                continue
            torch._foreach_add_(steps, 1)
            # Shards step together when they share the update count (all of them, unless some had no
            # gradient on some update), the kind of state, the device and the dtypes.
            batches = defaultdict(list)
            for param, step in zip(with_grads, torch.stack(steps).tolist()):
                state = self.state[param]
                shard = _Shard(_local(param), _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                if shard.param.numel() == 0:  # an uneven shard can leave a rank no values of this tensor
                    continue
                is_8bit = isinstance(shard.exp_avg, OptimState8bit)
                batches[(step, is_8bit, shard.param.device, shard.param.dtype, shard.grad.dtype)].append(shard)
            chunks_stepped = 0
            for (step, is_8bit, _, _, _), shards in batches.items():
                chunks_stepped += self._step_shards(shards, group, step, is_8bit, chunks_stepped)

    def _step_shards(self, shards: list[_Shard], group: dict, step: float, is_8bit: bool, first_chunk: int) -> int:
        """Step shards of one kind in chunks; returns the number of chunks. `first_chunk` numbers them within
        the update, which keys their stochastic rounding."""
        beta1, beta2 = group["betas"]
        step_settings = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"], torch.tensor(step))
        # torch.compile cannot trace under a dispatch mode (the memory estimate's fake tensors and trackers,
        # memory_estimate.py): the same functions run eagerly there, their temporaries an upper bound.
        eager = is_in_torch_dispatch_mode()
        step_8bit_moments = _step_8bit_moments if eager else _compiled_step_8bit_moments
        adamw = _adamw if eager else _compiled_adamw
        chunks = list(runs_of_at_most(shards, [shard.param.numel() for shard in shards], CHUNK_VALUES))
        for chunk_number, chunk in enumerate(chunks, start=first_chunk):
            params, grads, exp_avgs, exp_avg_sqs = (list(tensors) for tensors in zip(*chunk))
            if is_8bit:
                new_param, avg_codes, avg_scale, sq_codes, sq_scale = step_8bit_moments(
                    _flat(params), _flat(grads),
                    _flat([state.codes for state in exp_avgs]), torch.cat([state.scale for state in exp_avgs]),
                    _flat([state.codes for state in exp_avg_sqs]), torch.cat([state.scale for state in exp_avg_sqs]),
                    exp_avgs[0].qmap, exp_avg_sqs[0].qmap, *step_settings,
                )  # fmt: skip
                _write_back([state.codes for state in exp_avgs], avg_codes)
                _write_back([state.scale for state in exp_avgs], avg_scale)
                _write_back([state.codes for state in exp_avg_sqs], sq_codes)
                _write_back([state.scale for state in exp_avg_sqs], sq_scale)
            else:
                new_param, exp_avg, exp_avg_sq = adamw(_flat(params), _flat(grads), _flat(exp_avgs), _flat(exp_avg_sqs), *step_settings)
                _write_back(exp_avgs, exp_avg)
                _write_back(exp_avg_sqs, exp_avg_sq)
            if params[0].dtype == torch.bfloat16:
                new_param = round_to_bf16(new_param, rounding_key(int(step), chunk_number))
            _write_back(params, new_param)
        return len(chunks)


class AdamWFp32Moments(AdamW8bit):
    """AdamW with both moments in fp32 (torch AdamW's state and checkpoint layout) and AdamW8bit's
    multi-tensor step: --optimizer adamw over bf16 weights, which torch's AdamW would round to nearest."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:  # noqa: ARG002 - moments are never quantised
        return fp32_zeros_like(p)
