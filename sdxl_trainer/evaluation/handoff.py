"""Handing the trained UNet (and text encoders, where they are trained) to every process for inference
(validation images, sample grids).

The training models are sharded: no process holds their full weights. Rank 0 gathers them one tensor at a
time into CPU memory and writes them, in the inference dtype, to a RAM-disk folder (`/dev/shm` where it
exists, else the system temp folder, or --handoff_dir); then every rank loads the base pipeline with those
weights. So each GPU holds its training shards plus one inference copy, never two full training copies.
The folder is unique per run and removed when the `with` block ends, also on error.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from sdxl_trainer.distributed.world import broadcast_text
from sdxl_trainer.models.components import ComponentWeights
from sdxl_trainer.models.single_file import load_pipeline

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import StableDiffusionXLPipeline

def default_handoff_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


class PipelineHandoff:
    """Collective context manager. Inside it, `pipeline(weights_on_rank0)` returns, on every rank, the
    base pipeline with the given trained weights, on the rank's device and in `dtype`."""

    def __init__(self, root: Path | None, run_name: str, base_model: str, single_file_config: str, device: torch.device, dtype: torch.dtype,
                 vae_name_or_path: str | None = None):
        token = broadcast_text(uuid.uuid4().hex if dist.get_rank() == 0 else "", device)  # one folder name for every rank of this run
        self.folder = (root or default_handoff_root()) / f"sdxl_handoff_{run_name}_{token}"
        self.base_model = base_model
        self.single_file_config = single_file_config
        self.vae_name_or_path = vae_name_or_path
        self.device = device
        self.dtype = dtype

    def __enter__(self) -> "PipelineHandoff":
        return self

    def __exit__(self, *exc_info) -> None:
        # Every rank removes it (no barrier: on error the others may never arrive); removing twice is harmless.
        shutil.rmtree(self.folder, ignore_errors=True)

    def pipeline(self, weights_on_rank0: ComponentWeights) -> StableDiffusionXLPipeline:
        """The base pipeline with rank 0's trained weights (component name -> state dict: "unet", and
        the text encoders where they were trained) on every rank."""
        names = broadcast_text(",".join(weights_on_rank0) if dist.get_rank() == 0 else "", self.device).split(",")
        if dist.get_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            for name, state in weights_on_rank0.items():
                weights_file = self.folder / f"{name}.safetensors"
                tmp_file = weights_file.with_name(weights_file.name + ".tmp")
                save_file({key: tensor.to(self.dtype).contiguous() for key, tensor in state.items()}, str(tmp_file))
                tmp_file.replace(weights_file)
        dist.barrier()
        pipeline = load_pipeline(self.base_model, self.single_file_config, self.dtype, self.vae_name_or_path)
        for name in names:
            getattr(pipeline, name).load_state_dict(load_file(str(self.folder / f"{name}.safetensors")), strict=True)
        dist.barrier()  # every rank has read the files before anyone may replace or remove them
        return pipeline.to(self.device)
