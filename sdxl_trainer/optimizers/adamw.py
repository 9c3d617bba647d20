"""fp32 AdamW over local shards, many tensors per kernel.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.shards import StepsIfFinite, _entries_per_group, fp32_zeros_like


class ShardAdamW(StepsIfFinite, torch.optim.AdamW):
    """torch's fused AdamW (torch.optim.adamw.adamw, fused=True) run on each rank's local shards, with torch
    AdamW's state (step, exp_avg, exp_avg_sq) and so its checkpoints. Called on DTensors, the same kernel
    first works out how each of its arguments is sharded, at a run's first update and again when a resume
    sets up the state, which over SDXL's 1,680 tensors takes a CPU core far longer than the step itself
    (benchmarks/bench_optimizer_step.py; docs/training.md, "Learning rate and optimizers"). AdamW is
    elementwise, so the local shards give the same values bit for bit. No amsgrad, no loss scaling (fp16 steps torch's AdamW)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self, closure=None, *, finite: torch.Tensor | None = None):  # noqa: ARG002 - torch.optim signature
        """The step, left undone where `finite` (a bool scalar on the device) is False; None: always."""
        for group, entries in _entries_per_group(self, self._new_state):
            beta1, beta2 = group["betas"]
            # Moved here, not by the kernel: with --cpu_offload the shards are in host memory, and the kernel's
            # own non-blocking copy to the host could be read before it lands.
            found_inf = None if finite is None else (~finite).to(entries[0].weights.device, torch.float32)
            adamw(
                [entry.weights for entry in entries], [entry.grad for entry in entries],
                [local_shard(entry.state["exp_avg"]) for entry in entries], [local_shard(entry.state["exp_avg_sq"]) for entry in entries],
                [], [entry.state["step"] for entry in entries],
                fused=True, found_inf=found_inf, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=False,
            )  # fmt: skip

    @staticmethod
    def _new_state(param: torch.Tensor) -> dict:
        # The step count as torch's fused AdamW keeps it: a float32 scalar on the parameters' device.
        return {"step": torch.zeros((), dtype=torch.float32, device=local_shard(param).device), "exp_avg": fp32_zeros_like(param), "exp_avg_sq": fp32_zeros_like(param)}
