"""The gradients' global 2-norm over FSDP2's shards, and clipping by it: each rank's local shards measured,
their squares summed over the ranks in one all-reduce. The ordinary step clips by it (TrainStep); the
optimizer in backward measures each unit's (in_backward.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sdxl_trainer.distributed.local_shard import local_shard


@torch.no_grad()  # the shards are measured and scaled in place, outside autograd
def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) on each rank's local shards: the squared norms of a rank's
    shards are summed and all-reduced once over the ranks that hold different shards, and each shard is
    scaled in place. Same norm and gradients as torch's (tests/training/test_train_step.py,
    tests/distributed/test_hsdp.py), where torch's works out the sharding of every foreach op over the
    DTensors on the host, which costs it more per update and most on a process's first update (what
    bench_optimizer_step.py --sdxl_tensor_count --sharded showed: docs/training.md, "Batches, data order and
    run length"). Returns the norm before clipping; with max_norm inf it only measures."""
    squares, by_dtype = squared_norm([parameter.grad for parameter in parameters if parameter.grad is not None])
    norm = squares.sqrt()
    if math.isfinite(max_norm):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for shards in by_dtype.values():
            torch._foreach_mul_(shards, scale.to(shards[0].device))
    return norm


def squared_norm(grads: list[torch.Tensor]) -> tuple[torch.Tensor, dict[torch.dtype, list[torch.Tensor]]]:
    """The squared 2-norm of `grads` (DTensors in one layout, or plain tensors) over all their shards: each
    rank's local shards' squares summed, then all-reduced once over the ranks that hold other shards. Also
    returns the local shards by dtype. clip_gradients' norm, and the optimizer in backward's per unit."""
    layouts = {(grad.device_mesh, grad.placements) for grad in grads if isinstance(grad, DTensor)}
    assert len(layouts) <= 1 and (not layouts or all(isinstance(grad, DTensor) for grad in grads)), f"gradients in several layouts: {layouts}"
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        shard = local_shard(grad)
        by_dtype.setdefault(shard.dtype, []).append(shard)
    # Each norm in fp32 from the foreach op itself: bf16 gradients' norms came back in bf16, and casting them one by
    # one cost an operator per tensor (1,680 per update with --weights_dtype bf16: benchmarks/count_host_work.py).
    norms = [norm for shards in by_dtype.values() for norm in torch._foreach_norm(shards, 2.0, dtype=torch.float32)]
    squares = torch.stack(norms).square().sum()
    for mesh, placements in layouts:
        squares = squares.to(mesh.device_type)  # with --cpu_offload the shards are in host memory, NCCL reduces on the GPU
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(squares, group=mesh.get_group(dim))
    return squares, by_dtype
