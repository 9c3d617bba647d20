"""What one rank's collectives move, by kind: counted under any run (real gloo or NCCL collectives, or the
fake process group's), and counted for the estimate's two updates at full size on fake tensors."""

from __future__ import annotations

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from sdxl_trainer.estimates.fake_run import EstimateSettings, ValuesReadAsOne, build_estimate_run, fake_world, train_two_updates, zero_gradients
from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG


class CollectiveBytes(TorchDispatchMode):
    """Counts, by kind, the bytes of the collectives that run under it (c10d's all-gather, reduce-scatter and
    all-reduce, as FSDP2 and the trainer call them), in forward and backward: a public dispatch mode, no patch.
    `least_bytes` leaves out the small ones (a loss or a norm all-reduced)."""

    def __init__(self, least_bytes: int = 64):
        super().__init__()
        self.least_bytes = least_bytes
        self.kinds = {torch.ops.c10d._allgather_base_: "all_gather", torch.ops.c10d._reduce_scatter_base_: "reduce_scatter", torch.ops.c10d.allreduce_: "all_reduce"}
        self.bytes = dict.fromkeys(self.kinds.values(), 0)
        self.calls = dict.fromkeys(self.kinds.values(), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.kinds.get(func.overloadpacket)
        if kind is not None:
            tensor = {"all_gather": lambda: args[0], "reduce_scatter": lambda: args[1], "all_reduce": lambda: args[0][0]}[kind]()
            size = tensor.numel() * tensor.element_size()
            if size >= self.least_bytes:
                self.bytes[kind] += size
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))


def count_collectives(settings: EstimateSettings, unet_config: dict | None = None) -> CollectiveBytes:
    """What one rank's collectives move in estimate_memory's two updates, on fake tensors over the fake process
    group (its first update, the optimizer's alone, moves nothing): the speed estimate's byte count, checked at
    full size by tests/estimates/test_speed_estimate.py."""
    with fake_world(settings.world_size, torch.device("cpu")) as world, FakeTensorMode(allow_non_fake_inputs=True), tracing(TracingContext(FakeTensorMode())):
        run = build_estimate_run(settings, world, unet_config or SDXL_UNET_CONFIG, None)
        zero_gradients(run)
        with CollectiveBytes() as counted, ValuesReadAsOne():
            train_two_updates(run, world.device)
    return counted
