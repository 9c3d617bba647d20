"""Run under torchrun by test_adamw8bit.py: our multi-tensor AdamW8bit and torchao's per-tensor one step
the same FSDP2-sharded model (uneven shards, one that leaves rank 1 no rows) with the same gradients; each
rank writes how far the two drift apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torchao.optim import AdamW8bit as TorchaoAdamW8bit

from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.optimizers.adamw8bit import AdamW8bit

# FSDP2 shards dim 0: 3 x 4096 splits 2 + 1 rows (8-bit state on both ranks), 1 x 300 leaves rank 1 no
# values, 12 x 320 is too small for 8 bits (fp32 state), 5 x 1000 splits 3 + 2 rows whose shards are no
# multiple of the 256-value block (fp32 state).
SHAPES = [(3, 4096), (1, 300), (12, 320), (64, 512), (5, 1000)]


def sharded_model(world) -> torch.nn.ParameterList:
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES])
    fully_shard(model, mesh=world.mesh)
    return model


def main(output_dir: str) -> None:
    world = init_distributed()
    ours, theirs = sharded_model(world), sharded_model(world)
    settings = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    optimizers = [AdamW8bit(ours.parameters(), **settings), TorchaoAdamW8bit(theirs.parameters(), **settings)]
    for update in range(4):
        torch.manual_seed(100 + update)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            grad = torch.randn(a.shape)
            a.grad = distribute_tensor(grad, world.mesh, a.placements)
            b.grad = distribute_tensor(grad.clone(), world.mesh, b.placements)
        optimizers[0].step()
        with torch.compiler.set_stance("force_eager"):  # torchao's per-shape compiles: see test_adamw8bit.py
            optimizers[1].step()
    local_rows = [a.to_local().shape[0] for a in ours.parameters()]
    weight_difference = max(
        (a.to_local() - b.to_local()).abs().max().item() if a.to_local().numel() else 0.0 for a, b in zip(ours.parameters(), theirs.parameters())
    )
    kinds = [type(optimizers[0].state[a]["exp_avg"].to_local()).__name__ for a in ours.parameters()]
    Path(output_dir, f"rank{world.rank}.json").write_text(json.dumps({"local_rows": local_rows, "weight_difference": weight_difference, "state_kinds": kinds}))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
