"""What one step of Adafactor or CAME does, recounted for speed_estimate.FACTORED_STEP_WORK: operators dispatched
and bytes read and written, over whole tensors (test_speed_estimate.py) or FSDP2's dim-0 shards (run on 2
processes by the same test, through this file's main):

    factored_step_work.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.estimates.host_work import HostWork
from sdxl_trainer.optimizers.adafactor import Adafactor
from sdxl_trainer.optimizers.came import CAME

OPTIMIZERS = {"adafactor": Adafactor, "came": CAME}
FACTORED, UNFACTORED = (512, 512), (1 << 18,)


class OperatorBytes(TorchDispatchMode):
    """Bytes of every tensor each non-view operator under it reads or writes (its inputs and outputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.bytes += sum(tensor.numel() * tensor.element_size() for tensor in tree_leaves((args, kwargs, result)) if isinstance(tensor, torch.Tensor))
        return result


def step_work(optimizer_class, shapes: list[tuple[int, ...]], layout: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, float]:
    """Operators of one step of `optimizer_class` (as TrainStep calls it, with a verdict) over fp32 weights of
    these shapes laid out by `layout`, their state made by a first step, and the bytes its operators read and
    write per value of this rank's shards."""
    parameters = [torch.nn.Parameter(layout(torch.randn(shape))) for shape in shapes]
    optimizer = optimizer_class(parameters, lr=1e-3)
    for parameter, shape in zip(parameters, shapes):
        parameter.grad = layout(torch.randn(shape))
    optimizer.step(finite=torch.tensor(True))
    with HostWork(by_part=False) as counts, OperatorBytes() as traffic:
        optimizer.step(finite=torch.tensor(True))
    return counts.total_ops, traffic.bytes / sum(local_shard(parameter).numel() for parameter in parameters)


def recount(optimizer_class, layout: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor) -> dict:
    """The step's work as FACTORED_STEP_WORK states it: the operators one more run of each kind (another shape)
    adds, those of a step over one run of each kind less those, what one more tensor of a shape adds (it joins
    that shape's run), and the bytes per value of a run of two large tensors of each kind."""
    ops, _ = step_work(optimizer_class, [FACTORED, UNFACTORED], layout)
    per_run = {
        "factored": step_work(optimizer_class, [FACTORED, (256, 1024), UNFACTORED], layout)[0] - ops,
        "unfactored": step_work(optimizer_class, [FACTORED, UNFACTORED, (1 << 17,)], layout)[0] - ops,
    }
    return {
        "ops_per_update": ops - sum(per_run.values()),
        "ops_per_run": per_run,
        "bytes_per_value": {kind: step_work(optimizer_class, [shape, shape], layout)[1] for kind, shape in (("factored", FACTORED), ("unfactored", UNFACTORED))},
        "ops_of_one_more_tensor_of_a_shape": step_work(optimizer_class, [FACTORED, FACTORED, UNFACTORED, UNFACTORED], layout)[0] - ops,
    }


def main(output_dir: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed

    world = init_distributed()
    report = {name: recount(optimizer_class, lambda tensor: distribute_tensor(tensor, world.mesh, [Shard(0)])) for name, optimizer_class in OPTIMIZERS.items()}
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
