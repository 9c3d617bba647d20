"""--compile_unet (regional compilation of the UNet's blocks) in the trainer's own path: with gradient
checkpointing, more bucket shapes than Dynamo's recompile limit, and backward in another global state than
the forward, as on a GPU.

Why the last: on CUDA, backward runs on the autograd engine's device thread, whose global state (its thread
count) and per-thread Dynamo settings differ from the forward's. Where checkpointing sits outside the compiled
blocks, every block recomputed in backward misses the forward's graphs and compiles again; once Dynamo's
recompile limit is reached it recomputes eagerly what the forward ran compiled, and checkpointing refuses the
different tensors ("Recomputed values ... have different metadata"): the crash of --compile_unet on an H200
(benchmarks/results/2026-11-26-h200-compile_unet-rerun.log). Here a hook at the start of backward changes
the thread count, which is one of the global state Dynamo's guards compare.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel
from unet_batches import make_train_step, synthetic_batch

from sdxl_trainer.distributed.fsdp import prepare_unet, shard_unet

# Latent sizes of four buckets: more than the recompile limit the test leaves Dynamo.
BUCKET_SHAPES = ((16, 16), (16, 24), (24, 16), (24, 24))


def backward_in_another_thread_state(unet: torch.nn.Module) -> None:
    """At the start of every backward through the UNet, another thread count, as the CUDA autograd thread has;
    the forward's count comes back with the next forward."""
    forward_threads = torch.get_num_threads()

    def on_output(_module, _inputs, output) -> None:
        torch.set_num_threads(forward_threads)
        output.sample.register_hook(lambda gradient: torch.set_num_threads(forward_threads + 1))

    unet.register_forward_hook(on_output)


@pytest.mark.slow
@pytest.mark.parametrize("layout,weights_dtype", [("plain", torch.float32), ("fsdp2", torch.bfloat16)])
def test_compiled_blocks_with_checkpointing_train_every_bucket_shape(world, tiny_pipeline_dir, layout, weights_dtype):
    threads = torch.get_num_threads()
    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet").to(weights_dtype)
    unet.enable_gradient_checkpointing()
    unet.train()
    compute_dtype = None if weights_dtype == torch.float32 else weights_dtype  # bf16 weights compute in bf16, as the trainer does
    if layout == "fsdp2":
        shard_unet(unet, world.mesh, param_dtype=compute_dtype, compile_blocks=True)
    else:
        prepare_unet(unet, world, param_dtype=compute_dtype, compile_blocks=True)
    backward_in_another_thread_state(unet)
    optimizer = torch.optim.SGD(unet.parameters(), lr=1e-3)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir)
    losses = []
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            for number, (height, width) in enumerate(BUCKET_SHAPES):
                batch = synthetic_batch(unet, [0, 1], seed=number, height=height, width=width)
                losses.append(step([batch], epoch=0).loss)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == len(BUCKET_SHAPES) and all(torch.isfinite(torch.tensor(losses)))
