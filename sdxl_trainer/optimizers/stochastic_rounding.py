"""Stochastic rounding of fp32 values to bf16, for bf16 master weights (--weights_dtype bf16).

bf16 keeps 8 significant bits: on a weight of 0.05 one bf16 step (ulp) is 2.4e-4, so an AdamW update of
about the learning rate (1e-5) is a twentieth of it, and rounding to the nearest bf16 value drops it
every time: training stalls. Stochastic rounding rounds up with probability equal to the share of the
step the exact value has passed, so the stored weight is right in expectation and small updates land on
average (Gupta et al. 2015; Zamirai et al. 2020 for bf16 training).

The random bits are a hash of (key, position), not draws from a generator: nothing to checkpoint (a
resume rounds exactly as the straight run did when it passes the same keys), nothing to thread through
FSDP's DTensors, and a compiled kernel computes them in registers. Optimizers key each update by its
step count and the tensor or chunk it rounds (rounding_key); an update's keys are hashed together, once
(rounding_keys), and each rounding picks its own inside the compiled kernel, so a key costs no operator per
chunk or tensor on the host (hashed eagerly one at a time, each took about 23).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

from sdxl_trainer.optimizers.shards import host_values_to, unflatten_tensors

_LOW_32_BITS = 0xFFFFFFFF
# bf16 is the upper half of an fp32's bits: these are the bits rounding discards.
_DISCARDED_BITS = 16
_KEPT_BITS_MASK = -(1 << _DISCARDED_BITS)  # 0xFFFF0000 as an int32


def _mix32(value):
    """A 32-bit integer hash (two multiply-xorshift rounds): every input bit affects every output bit.
    Works on Python ints and on int64 tensors; values stay below 2^32 and products below 2^59, so int64
    arithmetic never overflows."""
    value = ((value >> 16) ^ value) * 0x45D9F3B & _LOW_32_BITS
    value = ((value >> 16) ^ value) * 0x45D9F3B & _LOW_32_BITS
    return (value >> 16) ^ value


def rounding_key(step: int | torch.Tensor, stream: int | torch.Tensor) -> int | torch.Tensor:
    """The 32-bit key of one rounding: `step` is the optimizer's update count (different random bits every
    update), `stream` tells apart the tensors or chunks rounded in one update. A step count given as an int64
    tensor on the device gives the same key as a tensor there, without reading the count on the host."""
    return _mix32(_mix32(step & _LOW_32_BITS) ^ (stream & _LOW_32_BITS))


def rounding_keys(steps: torch.Tensor, streams: list[int] | torch.Tensor) -> torch.Tensor:
    """The keys of an update's roundings, hashed in one go on the device: `steps` holds their update counts
    (one for all, or one each, any dtype of whole values), `streams` tells them apart (a tensor on the
    device, or a list copied there without a wait). Each key equals rounding_key(step, stream)."""
    if not isinstance(streams, torch.Tensor):
        streams = host_values_to(streams, torch.int64, steps.device)
    return rounding_key(steps.long(), streams)


def _round_to_bf16(values: torch.Tensor, keys: torch.Tensor, index: int | None) -> torch.Tensor:
    """`values`: 1-D, contiguous fp32 (round_to_bf16 makes it so); the key: `keys` (0-d), or its element
    `index`. Picked here, as an index the kernel reads, the key costs no operator on the host. (A stream
    passed as an int for the kernel to hash fails to compile on the CPU: Inductor computes the int scalar in
    the float vector's type, and float has no xor.)"""
    key = keys if index is None else keys[index]
    position = torch.arange(values.numel(), device=values.device, dtype=torch.int64)
    random_bits = (_mix32(position ^ key) & ((1 << _DISCARDED_BITS) - 1)).to(torch.int32)
    # Adding uniform random bits below the kept ones carries into the kept part with probability equal to
    # the discarded fraction; a negative float's bits are sign + magnitude, so its magnitude rounds the
    # same way. The largest finite fp32 plus the bits stays below 2^31, so the sum cannot overflow.
    bits = (values.view(torch.int32) + random_bits) & _KEPT_BITS_MASK
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the discarded bits are zero


_compiled_round_to_bf16 = torch.compile(_round_to_bf16, dynamic=True, fullgraph=True)


def runs_compiled() -> bool:
    """Whether torch.compile compiles here: not under a dispatch mode that sees every operator (the memory
    estimate's fake tensors and trackers), where Dynamo would run the function eagerly anyway; a mode that
    ignores compile internals (the host-work count) leaves compiled code compiled."""
    return not any_torch_dispatch_mode_on_stack()


def round_to_bf16(values: torch.Tensor, key: int | torch.Tensor, index: int | None = None) -> torch.Tensor:
    """`values` rounded stochastically to bf16, the random bits fixed by `key` (rounding_key), or with `index`
    by element `index` of the 1-D tensor of keys `key` (rounding_keys), and each value's position (in
    row-major order). Compiled where runs_compiled() says so, else eager: the compiled
    function sees one kind of input, a 1-D contiguous fp32 tensor of any length, so every caller's tensors
    share one graph (each dimensionality, dtype or layout would be a graph of its own, and a process that
    rounds many kinds would run past Dynamo's recompile limit, a hard error under fullgraph)."""
    round_fn = _compiled_round_to_bf16 if runs_compiled() else _round_to_bf16
    flat = values.float().contiguous().view(-1).detach()  # detached: no view base for Dynamo to guard on
    return round_fn(flat, torch.as_tensor(key, dtype=torch.int64, device=values.device), index).view(values.shape)


def keys_by_first_tensor(runs: list[list], steps: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The keys of runs of entries (shards._Entry) rounded at once, each keyed by its first entry's step count
    (`steps`, by entry number: shards.device_step_counts) and number; None where no run holds bf16 weights."""
    if not any(run[0].weights.dtype == torch.bfloat16 for run in runs):
        return None
    return rounding_keys(torch.stack([steps[run[0].index] for run in runs]), [run[0].index for run in runs])


def store_run(weights: list[torch.Tensor], new_values: torch.Tensor, keys: torch.Tensor | None, index: int) -> None:
    """Write an optimizer's flat fp32 result for a run of local tensors of one dtype into them: as it is into
    fp32 weights, into bf16 ones rounded once for the whole run with key `keys[index]` (rounding_keys; None
    for fp32 weights), the positions running through the run: no operator per tensor but the one copy that
    writes them all. Other dtypes are refused."""
    dtype = weights[0].dtype
    if dtype == torch.bfloat16:
        new_values = round_to_bf16(new_values, keys, index)
    elif dtype != torch.float32:
        raise TypeError(f"weights of dtype {dtype}: stochastic rounding is for bf16 weights")
    torch._foreach_copy_(weights, unflatten_tensors(new_values, weights))
