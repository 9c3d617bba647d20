"""Per-block learning rates of the UNet (--block_lr), with the semantics of kohya sd-scripts' SDXL --block_lr.

kohya splits the UNet by the module names of the original (ldm / single-file) layout into 23 blocks for SDXL,
in this order:
  0       the time and size embeddings (time_embed, label_emb)
  1-9     input_blocks 0-8: conv_in; down level 0's two ResNets and its downsampler; levels 1 and 2's two
          (ResNet + transformer) layers each, with level 1's downsampler between them
  10-12   middle_block 0-2: ResNet, transformer, ResNet
  13-21   output_blocks 0-8: each up level's three (ResNet [+ transformer]) layers, the upsampler with the
          level's last layer
  22      the output norm and conv (out)
Each block's parameters form one optimizer param group at the block's rate; a rate of 0 leaves the block
out of the optimizer and frozen (kohya leaves it out too; here its weights also get no gradient). Diffusers'
parameter names are mapped to the ldm ones by the single-file export's own table (models/single_file.py),
so a UNet of another size splits the same way (the tiny test UNet into 13 blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sdxl_trainer.config import option
from sdxl_trainer.distributed.fsdp import parameter_names
from sdxl_trainer.models.single_file import unet_ldm_names, unet_module_map

SDXL_BLOCK_COUNT = 23
MIDDLE_BLOCKS = 3  # ResNet, transformer, ResNet


@dataclass(kw_only=True)
class BlockRateOptions:
    """Per-block learning rates"""

    block_lr: list[float] | None = option(
        None,
        help="peak learning rate of each UNet block, as kohya sd-scripts' SDXL --block_lr: 23 values for SDXL (0 the time and size "
        "embeddings, 1-9 conv_in and the down path, 10-12 the mid block, 13-21 the up path, 22 the output layers; docs/training.md), "
        "given space-separated or as a TOML array (kohya takes them comma-separated); the schedule scales each as it scales "
        "--learning_rate, which stays the text encoders' default; 0 keeps a block frozen; None = --learning_rate for the whole UNet",
    )

    def problems(self) -> list[str]:
        if self.block_lr is None:
            return []
        problems = []
        if any(not rate >= 0 for rate in self.block_lr):
            problems.append(f"--block_lr rates must be >= 0 (0 keeps that block frozen), got {self.block_lr}")
        elif not any(self.block_lr):
            problems.append("--block_lr gives every UNet block 0, so the UNet would not train: give at least one block a rate")
        return problems

    def frozen_unet_blocks(self) -> str:
        """The UNet blocks kept frozen by a rate of 0, comma-separated ("" if none): the checkpoint records them."""
        return ",".join(str(block) for block, rate in enumerate(self.block_lr or []) if rate == 0)


def _ldm_block_counts(unet_config: dict) -> tuple[int, int]:
    """How many input_blocks and output_blocks the ldm layout of a UNet with this (diffusers) config has."""
    ldm_modules = unet_module_map(unet_config).values()
    return tuple(1 + max(int(module.split(".")[1]) for module in ldm_modules if module.startswith(f"{kind}.")) for kind in ("input_blocks", "output_blocks"))


def unet_block_count(unet_config: dict) -> int:
    """The number of blocks kohya's split makes of a UNet with this config: 23 for SDXL's."""
    input_blocks, output_blocks = _ldm_block_counts(unet_config)
    return 1 + input_blocks + MIDDLE_BLOCKS + output_blocks + 1


def block_count_problem(block_lr: list[float] | None, unet_config: dict) -> str | None:
    count = unet_block_count(unet_config)
    if block_lr is None or len(block_lr) == count:
        return None
    return f"--block_lr has {len(block_lr)} values, but this UNet has {count} blocks (kohya's split; SDXL's has {SDXL_BLOCK_COUNT}): give one rate per block"


def _block_of(ldm_name: str, input_blocks: int, last_block: int) -> int:
    """kohya's block of a UNet parameter by its ldm name."""
    top, index = ldm_name.split(".")[:2]
    if top in ("time_embed", "label_emb"):
        return 0
    if top == "input_blocks":
        return 1 + int(index)
    if top == "middle_block":
        return 1 + input_blocks + int(index)
    if top == "output_blocks":
        return 1 + input_blocks + MIDDLE_BLOCKS + int(index)
    if top == "out":
        return last_block
    raise ValueError(f"UNet parameter {ldm_name!r} (ldm name) is in none of kohya's blocks")


def unet_blocks(unet: nn.Module) -> list[list[nn.Parameter]]:
    """The UNet's parameters in kohya's blocks (index = block), each in the UNet's parameter order; works on a
    plain UNet and on one prepared for training (FSDP2 shards, compiled blocks)."""
    count = unet_block_count(unet.config)
    input_blocks, _ = _ldm_block_counts(unet.config)
    names = parameter_names(unet)
    ldm_names = unet_ldm_names(names, unet.config)
    blocks: list[list[nn.Parameter]] = [[] for _ in range(count)]
    for name, parameter in zip(names, unet.parameters()):
        blocks[_block_of(ldm_names[name], input_blocks, count - 1)].append(parameter)
    return blocks


def freeze_zero_rate_blocks(unet: nn.Module, block_lr: list[float] | None) -> None:
    """The blocks at a rate of 0 frozen (no gradient), before the UNet is prepared for training."""
    for rate, parameters in zip(block_lr or [], unet_blocks(unet)):
        if rate == 0:
            for parameter in parameters:
                parameter.requires_grad_(False)
