"""How many graphs --compile_unet's compiled blocks hold as bucket shapes arrive, and whether Dynamo's recompile
limit (past which a block runs eagerly) is reached: counted on a CPU.

    venv/bin/python benchmarks/count_compiled_graphs.py [--latents 48x48 40x40 32x48 ...] [--json OUT]

SDXL's UNet at a narrow width (models/sdxl.py NARROW_SDXL_UNET_CONFIG: every block of the published
architecture), gradient checkpointing on, compiled by the trainer's own compile_repeated_blocks; one forward and
backward at batch 2 per latent size (height x width), in order. After each, the graphs Dynamo keeps for the
compiled forward every block shares (the checkpoint wrapper's), against the recompile limit the trainer gave it. Graphs do not depend on the width, only on the blocks' configurations and
the shapes that arrive.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.lib.results import write_json  # noqa: E402

DEFAULT_LATENTS = ("48x48", "40x40", "32x48", "48x32", "40x48", "48x40", "32x32")


def random_inputs(config, height: int, width: int, batch: int = 2) -> dict:
    generator = torch.Generator().manual_seed(height * 1000 + width)
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    return {
        "sample": torch.randn(batch, config.in_channels, height, width, generator=generator),
        "timestep": torch.randint(0, 1000, (batch,), generator=generator),
        "encoder_hidden_states": torch.randn(batch, 77, config.cross_attention_dim, generator=generator),
        "added_cond_kwargs": {"text_embeds": torch.randn(batch, pooled, generator=generator), "time_ids": torch.randn(batch, 6, generator=generator)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latents", nargs="+", default=list(DEFAULT_LATENTS), help="latent sizes, HEIGHTxWIDTH, in the order they arrive")
    parser.add_argument("--json", type=Path, help="write the counts here, with the run's facts (date, machine, commit)")
    args = parser.parse_args(argv)

    from diffusers import UNet2DConditionModel
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from sdxl_trainer.distributed.fsdp import compile_repeated_blocks, recompile_limit_for
    from sdxl_trainer.models.sdxl import NARROW_SDXL_UNET_CONFIG

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**NARROW_SDXL_UNET_CONFIG)
    unet.enable_gradient_checkpointing()
    unet.train()
    compile_repeated_blocks(unet)
    limit = recompile_limit_for([module for module in unet.modules() if isinstance(module, CheckpointWrapper)])
    print(f"recompile limit given to each compiled block: {limit}")
    counts = []
    for latent in args.latents:
        height, width = map(int, latent.split("x"))
        start = time.perf_counter()
        unet(**random_inputs(unet.config, height, width)).sample.square().mean().backward()
        graphs = len(_debug_get_cache_entry_list(CheckpointWrapper.forward.__code__))
        counts.append({"latent": latent, "graphs": graphs, "seconds": round(time.perf_counter() - start, 1)})
        reached = " (the limit: later shapes it does not cover run eagerly)" if graphs >= limit else ""
        print(f"after {latent}: {graphs} graphs{reached}; {counts[-1]['seconds']} s", flush=True)
    if args.json:
        write_json(args.json, {"recompile_limit": limit, "buckets": counts}, torch.device("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
