"""The local shard of a DTensor, for code that works on each rank's shard (the optimizers, clipping, the EMA).

It is the DTensor's `_local_tensor`, read directly: to_local() returns the same tensor through autograd's
bookkeeping, which costs microseconds a call and adds up over SDXL's 1,680 tensors per update (docs/design.md,
section 6). None of these callers needs a gradient to flow back into the DTensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
