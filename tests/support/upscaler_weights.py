"""A tiny Real-ESRGAN network (RRDBNet) and its weight files, in the layouts upscaler files come in.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from spandrel.architectures.ESRGAN import ESRGAN


def tiny_rrdbnet(scale: int = 4, seed: int = 0) -> ESRGAN:
    """RRDBNet (ESRGAN / Real-ESRGAN / Remacri architecture) with 8 filters and 1 block instead of 64 and 23."""
    torch.manual_seed(seed)
    return ESRGAN(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=scale).eval()


def to_real_esrgan_keys(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old-format ESRGAN keys (model.N...., as in 4x_foolhardy_Remacri.pth) -> the Real-ESRGAN/BasicSR names
    used by RealESRGAN_x4plus.pth (conv_first, body.N.rdbM.convK, conv_body, conv_up1/2, conv_hr, conv_last)."""
    renamed = {}
    for key, value in old.items():
        parts = key.split(".")
        if parts[1] == "1":  # model.1.sub.<block or trunk>...
            if parts[4].startswith("RDB"):
                renamed[f"body.{parts[3]}.rdb{parts[4][3:]}.{parts[5]}.{parts[-1]}"] = value
            else:
                renamed[f"conv_body.{parts[-1]}"] = value
        else:
            name = {"0": "conv_first", "3": "conv_up1", "6": "conv_up2", "8": "conv_hr", "10": "conv_last"}[parts[1]]
            renamed[f"{name}.{parts[-1]}"] = value
    return renamed


def save_weights(network: torch.nn.Module, path: Path, real_esrgan_layout: bool = False) -> Path:
    state = {key: value.contiguous() for key, value in network.state_dict().items()}
    if real_esrgan_layout:
        state = to_real_esrgan_keys(state)
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save({"params_ema": state} if real_esrgan_layout else state, path)
    return path
