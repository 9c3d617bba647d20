"""An SDXL model's weights by component, read one tensor at a time from its safetensors files without building
the model: a diffusers folder or Hugging Face model id (its files as they are), or a single file in the
original layout (single_file.py's names) described by a diffusers config. LoRA extraction compares two
models of 7-14 GB each this way in a few hundred MB of memory.

Names are diffusers' (the text encoders' with the full Hugging Face `text_model.` names, hf_clip_name); a
weight reads in its stored dtype and in the shape diffusers gives it. Only floating-point tensors are weights
(CLIP's integer position_ids are not).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.single_file import (
    CLIP_G_PREFIX,
    CLIP_L_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    hf_clip_name,
    is_single_file,
    openclip_source,
    unet_ldm_names,
    vae_ldm_names,
)
from sdxl_trainer.runtime.tensor_files import DamagedHeader, TensorFile

COMPONENTS = ("unet", *TEXT_ENCODER_NAMES, "vae")
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' weight file names
CONFIG_FILES = {component: f"{component}/config.json" for component in COMPONENTS}
SCHEDULER_CONFIG_FILE = "scheduler/scheduler_config.json"


class ModelFilesError(ValueError):
    """A model's files cannot be read as SDXL weights; the message names the file and the fix."""


@dataclass(frozen=True)
class StoredWeight:
    """Where one weight lies in a file, and how the file stores it."""

    file: TensorFile
    key: str
    shape: tuple[int, ...]  # as diffusers shapes it
    third: int | None = None  # which third of OpenCLIP's fused q/k/v tensor
    transposed: bool = False  # OpenCLIP's text projection

    @property
    def dtype(self) -> torch.dtype:
        return self.file.entries[self.key].dtype

    def read(self) -> torch.Tensor:
        """The weight in its stored dtype (the file's bytes, nothing else in memory)."""
        tensor = self.file.read(self.key)
        if self.third is not None:
            tensor = tensor.chunk(3)[self.third]
        if self.transposed:
            tensor = tensor.T
        return tensor.reshape(self.shape)  # the VAE's attention projections are 1x1 convolutions in a single file


@dataclass
class ModelWeights:
    location: str  # as the user gave it
    configs: dict[str, dict]  # component -> its config.json
    v_prediction: bool  # the scheduler's objective (a single file's `v_pred` key counts too)
    weights: dict[str, dict[str, StoredWeight]]  # component -> weight name -> where it lies

    def module(self, component: str) -> torch.nn.Module:
        """The component built on the meta device from its config: its layers' names and types, no memory."""
        return meta_module(component, self.configs[component])

    @property
    def resolution(self) -> int:
        """The square image size the model was made for, in pixels (SDXL: 1024)."""
        return self.configs["unet"]["sample_size"] * 2 ** (len(self.configs["vae"]["block_out_channels"]) - 1)


def meta_module(component: str, config: dict) -> torch.nn.Module:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        if component == "unet":
            return UNet2DConditionModel.from_config(config)
        if component == "vae":
            return AutoencoderKL.from_config(config)
        model_class = CLIPTextModel if component == "text_encoder" else CLIPTextModelWithProjection
        return model_class(CLIPTextConfig.from_dict(config))


def open_model_weights(name_or_path: str, flag: str, single_file_config: str) -> ModelWeights:
    """The weights of the model `flag` names (a diffusers folder, Hugging Face model id or single file; a single
    file's architecture from `single_file_config`, a folder or model id). Reads headers and configs only."""
    try:
        if is_single_file(name_or_path):
            configs, scheduler = read_configs(single_file_config)
            return _single_file_weights(Path(name_or_path).expanduser(), configs, scheduler, name_or_path)
        path = Path(name_or_path).expanduser()
        folder = path if path.is_dir() else _hub_snapshot(name_or_path)
        configs, scheduler = read_configs(str(folder))
        weights = {component: _folder_weights(folder / component, component) for component in COMPONENTS}
        return ModelWeights(name_or_path, configs, scheduler.get("prediction_type") == "v_prediction", weights)
    except ModelFilesError as error:
        raise ModelFilesError(f"{flag} {name_or_path}: {error}") from None


def read_configs(source: str) -> tuple[dict[str, dict], dict]:
    """Every component's config and the scheduler's ({} if it has none) from a diffusers folder or model id."""
    read = _config_reader(source)
    scheduler = read(SCHEDULER_CONFIG_FILE, required=False) or {}
    return {component: read(file) for component, file in CONFIG_FILES.items()}, scheduler


def _config_reader(source: str) -> Callable[..., dict | None]:
    folder = Path(source).expanduser()

    def read(relative: str, required: bool = True) -> dict | None:
        if folder.is_dir():
            path = folder / relative
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

            try:
                path = Path(hf_hub_download(source, relative))
            except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: first
                raise ModelFilesError(
                    f"{relative} of {source} is not in the local Hugging Face cache and cannot be downloaded (offline): "
                    f"fetch it once with huggingface-cli download {source} --include '*.json', or give a local diffusers folder"
                ) from None
            except EntryNotFoundError:
                path = folder / relative  # missing: said below
        if not path.is_file():
            if required:
                raise ModelFilesError(f"{source} has no {relative}: a diffusers SDXL model holds one config.json per component")
            return None
        return json.loads(path.read_text(encoding="utf-8"))

    return read


def _hub_snapshot(model_id: str) -> Path:
    """The local folder of a hub model's configs and plain (non-variant) weights, downloaded where missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["model_index.json", SCHEDULER_CONFIG_FILE, *CONFIG_FILES.values()]
    for component in COMPONENTS:
        for stem in WEIGHT_STEMS:
            patterns += [f"{component}/{stem}.safetensors", f"{component}/{stem}.safetensors.index.json", f"{component}/{stem}-*-of-*.safetensors"]
    try:
        return Path(snapshot_download(model_id, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ModelFilesError("not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it first, or give a local path") from None
    except HfHubHTTPError as error:
        raise ModelFilesError(f"cannot be downloaded ({error}): check the model id and the network, or give a local path") from None


def _weight_files(folder: Path) -> list[Path]:
    """A component's weight files: the plain file or the shards its index lists; else a variant's
    (model.fp16.safetensors) where the folder holds only that."""
    for stem in WEIGHT_STEMS:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            return sorted({folder / name for name in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
        if (folder / f"{stem}.safetensors").is_file():
            return [folder / f"{stem}.safetensors"]
    variants = sorted(path for path in folder.glob("*.safetensors") if not path.name.startswith("."))
    if not variants:
        raise ModelFilesError(
            f"{folder} holds no .safetensors weights ({WEIGHT_STEMS[0]}.safetensors, {WEIGHT_STEMS[1]}.safetensors or their shards): "
            "re-save the model with save_pretrained (safetensors is its default), or download its .safetensors files"
        )
    return variants


def _open(path: Path) -> TensorFile:
    try:
        return TensorFile(path)
    except FileNotFoundError:
        raise ModelFilesError(f"{path} is missing (its index lists it): download or copy the model again") from None
    except DamagedHeader as error:
        raise ModelFilesError(f"{path} is not a readable safetensors file ({error}): download or copy it again") from None


def _folder_weights(folder: Path, component: str) -> dict[str, StoredWeight]:
    weights: dict[str, StoredWeight] = {}
    for path in _weight_files(folder):
        tensor_file = _open(path)
        for key, entry in tensor_file.entries.items():
            if entry.dtype.is_floating_point:
                weights.setdefault(hf_clip_name(key) if component in TEXT_ENCODER_NAMES else key, StoredWeight(tensor_file, key, entry.shape))
    return weights


def _single_file_source(component: str, names: list[str], config: dict) -> dict[str, tuple[str, int | None, bool]]:
    """Weight name -> (its key in a single file, third of a fused tensor or None, stored transposed)."""
    if component == "unet":
        return {name: (UNET_PREFIX + ldm, None, False) for name, ldm in unet_ldm_names(names, config).items()}
    if component == "vae":
        return {name: (VAE_PREFIX + ldm, None, False) for name, ldm in vae_ldm_names(names, config).items()}
    if component == "text_encoder":
        return {name: (CLIP_L_PREFIX + name, None, False) for name in names}
    sources = {}
    for name in names:
        key, third, transposed = openclip_source(name)
        sources[name] = (CLIP_G_PREFIX + key, third, transposed)
    return sources


def _single_file_weights(path: Path, configs: dict[str, dict], scheduler: dict, name: str) -> ModelWeights:
    tensor_file = _open(path)
    weights: dict[str, dict[str, StoredWeight]] = {}
    absent, mismatched = [], []
    for component in COMPONENTS:
        state = meta_module(component, configs[component]).state_dict()
        shapes = {hf_clip_name(key) if component in TEXT_ENCODER_NAMES else key: tuple(value.shape) for key, value in state.items() if value.is_floating_point()}
        weights[component] = {}
        for weight, (key, third, transposed) in _single_file_source(component, list(shapes), configs[component]).items():
            entry = tensor_file.entries.get(key)
            if entry is None:
                absent.append(key)
            elif math.prod(entry.shape) != math.prod(shapes[weight]) * (3 if third is not None else 1):
                mismatched.append(f"{key} {list(entry.shape)}")
            else:
                weights[component][weight] = StoredWeight(tensor_file, key, shapes[weight], third, transposed)
    if absent or mismatched:
        found = (f"{len(absent)} of its weights are missing ({', '.join(absent[:3])}...)" if absent else "") + \
            ("; " if absent and mismatched else "") + (f"{len(mismatched)} have other sizes ({', '.join(mismatched[:3])}...)" if mismatched else "")
        raise ModelFilesError(
            f"is not the SDXL single file its config describes (--single_file_config): {found}. Give the diffusers config of its architecture"
        )
    v_prediction = "v_pred" in tensor_file.entries or scheduler.get("prediction_type") == "v_prediction"
    return ModelWeights(name, configs, v_prediction, weights)
