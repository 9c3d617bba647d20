"""SDXL as one `.safetensors` file in the original (Stability "sgm") layout that A1111, ComfyUI, Forge and
kohya load, written from a diffusers pipeline; and loading such a file as the base model.

Layout of the file, by key prefix:
  model.diffusion_model.               UNet (ldm/sgm names: input_blocks / middle_block / output_blocks)
  first_stage_model.                   VAE (ldm names; attention projections as 1x1 convolutions)
  conditioner.embedders.0.transformer. CLIP ViT-L text encoder (Hugging Face names, as the original)
  conditioner.embedders.1.model.       OpenCLIP ViT-bigG text encoder (OpenCLIP names, fused q/k/v)
The key maps below are derived from each model's config (levels, layers per level, which levels have
attention), so the same code serves full-size SDXL and the tiny test pipeline. Loading goes through
diffusers' own single-file loader, an independent implementation, which the round-trip test relies on.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors.torch import save_file

from sdxl_trainer.runtime.files import make_shareable
from sdxl_trainer.runtime.tensor_files import WRITER_KEY

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTokenizer

SDXL_CONFIG_SOURCE = "stabilityai/stable-diffusion-xl-base-1.0"
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
CLIP_G_PREFIX = "conditioner.embedders.1.model."
SINGLE_FILE_WRITER = "single_file"  # save_single_file's WRITER_KEY mark

# Inside a ResNet block (UNet): diffusers name -> ldm name.
UNET_RESNET_NAMES = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
UNET_TOP_LEVEL = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
VAE_ATTENTION_NAMES = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def is_single_file(model_name_or_path: str) -> bool:
    return model_name_or_path.endswith(".safetensors")


def model_location_problem(name_or_path: str, flag: str) -> str | None:
    """Why `name_or_path` cannot be a model (None if it can): a local file or folder that does not exist, a
    name that is no Hugging Face model id, or a hub model missing from the local cache while offline."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not (path / "model_index.json").is_file():
        return (
            f"{flag} {name_or_path} is a folder but not a diffusers model: it has no model_index.json. A model folder holds model_index.json "
            "and unet/, text_encoder/, text_encoder_2/ and vae/ (each with its config.json and weights), as save_pretrained writes it "
            "(a run's OUTPUT_DIR/PROJECT_NAME/pipeline is one); give such a folder, a single-file .safetensors, or a Hugging Face model id"
        )
    if path.exists():
        return None if path.is_dir() or is_single_file(name_or_path) else f"{flag} {name_or_path} is a file but not a .safetensors model"
    looks_local = is_single_file(name_or_path) or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local:
        return f"{flag} {name_or_path} does not exist: give an existing diffusers folder, .safetensors file, or Hugging Face model id"
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return f"{flag} {name_or_path!r} is neither an existing file or folder nor a Hugging Face model id (like stabilityai/stable-diffusion-xl-base-1.0)"
    if hub_offline() and not isinstance(try_to_load_from_cache(name_or_path, "model_index.json"), str):
        return f"{flag} {name_or_path} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it first, or give a local path"
    return None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: Hugging Face models come from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def config_source(model_name_or_path: str, single_file_config: str) -> str:
    """Where the model's diffusers configs (scheduler, component architectures) are read from."""
    return single_file_config if is_single_file(model_name_or_path) else model_name_or_path


def unet_module_map(config: dict) -> dict[str, str]:
    """diffusers module path -> ldm module path for every block of a UNet with this config."""
    mapping = dict(UNET_TOP_LEVEL)
    levels = len(config["block_out_channels"])
    layers = config["layers_per_block"]
    input_index = 1
    for level, block_type in enumerate(config["down_block_types"]):
        for layer in range(layers):
            mapping[f"down_blocks.{level}.resnets.{layer}"] = f"input_blocks.{input_index}.0"
            if block_type.startswith("CrossAttn"):
                mapping[f"down_blocks.{level}.attentions.{layer}"] = f"input_blocks.{input_index}.1"
            input_index += 1
        if level < levels - 1:
            mapping[f"down_blocks.{level}.downsamplers.0.conv"] = f"input_blocks.{input_index}.0.op"
            input_index += 1
    mapping.update({"mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1", "mid_block.resnets.1": "middle_block.2"})
    output_index = 0
    for level, block_type in enumerate(config["up_block_types"]):
        has_attention = block_type.startswith("CrossAttn")
        for layer in range(layers + 1):
            mapping[f"up_blocks.{level}.resnets.{layer}"] = f"output_blocks.{output_index}.0"
            if has_attention:
                mapping[f"up_blocks.{level}.attentions.{layer}"] = f"output_blocks.{output_index}.1"
            if layer == layers and level < levels - 1:
                mapping[f"up_blocks.{level}.upsamplers.0.conv"] = f"output_blocks.{output_index}.{2 if has_attention else 1}.conv"
            output_index += 1
    return mapping


def _rename(key: str, module_map: dict[str, str], inner_names: dict[str, str] | None = None) -> str:
    """Replace the longest mapped module prefix of `key`; inside ResNet blocks also the layer names."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in module_map:
            rest = ".".join(parts[cut:])
            if inner_names and ".resnets." in prefix:
                for old, new in inner_names.items():
                    if rest.startswith(old + "."):
                        rest = new + rest[len(old) :]
                        break
            return f"{module_map[prefix]}.{rest}"
    raise KeyError(f"no single-file name for UNet weight {key!r}")


def unet_ldm_names(keys, config: dict) -> dict[str, str]:
    """diffusers UNet weight name -> its ldm name (without the file's UNET_PREFIX), for a UNet with this config."""
    module_map = unet_module_map(config)
    # Transformer blocks keep their names in both layouts (ldm's SpatialTransformer = diffusers' Transformer2DModel).
    return {key: _rename(key, module_map, UNET_RESNET_NAMES) for key in keys}


def unet_to_ldm(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    names = unet_ldm_names(state_dict, config)
    return {UNET_PREFIX + names[key]: value for key, value in state_dict.items()}


def _vae_module_map(config: dict) -> dict[str, str]:
    levels = len(config["block_out_channels"])
    layers = config["layers_per_block"]
    mapping = {"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
    for side in ("encoder", "decoder"):
        mapping.update(
            {f"{side}.conv_in": f"{side}.conv_in", f"{side}.conv_out": f"{side}.conv_out", f"{side}.mid_block.resnets.0": f"{side}.mid.block_1", f"{side}.mid_block.resnets.1": f"{side}.mid.block_2", f"{side}.mid_block.attentions.0": f"{side}.mid.attn_1"}
        )
    for level in range(levels):
        for layer in range(layers):
            mapping[f"encoder.down_blocks.{level}.resnets.{layer}"] = f"encoder.down.{level}.block.{layer}"
        if level < levels - 1:
            mapping[f"encoder.down_blocks.{level}.downsamplers.0.conv"] = f"encoder.down.{level}.downsample.conv"
        ldm_level = levels - 1 - level  # ldm numbers the decoder's levels from the output side
        for layer in range(layers + 1):
            mapping[f"decoder.up_blocks.{level}.resnets.{layer}"] = f"decoder.up.{ldm_level}.block.{layer}"
        if level < levels - 1:
            mapping[f"decoder.up_blocks.{level}.upsamplers.0.conv"] = f"decoder.up.{ldm_level}.upsample.conv"
    mapping.update({"quant_conv": "quant_conv", "post_quant_conv": "post_quant_conv"})
    return mapping


def vae_ldm_names(keys, config: dict) -> dict[str, str]:
    """diffusers VAE weight name -> its ldm name (without the file's VAE_PREFIX), for a VAE with this config."""
    module_map = _vae_module_map(config)
    names = {}
    for key in keys:
        name = _rename(key, module_map, {"conv_shortcut": "nin_shortcut"})
        if ".mid.attn_1." in name:
            for old, new in VAE_ATTENTION_NAMES.items():
                name = name.replace(f".attn_1.{old}.", f".attn_1.{new}.")
        names[key] = name
    return names


def vae_to_ldm(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    names = vae_ldm_names(state_dict, config)
    converted = {}
    for key, value in state_dict.items():
        if ".mid.attn_1." in names[key] and value.ndim == 2:
            value = value[:, :, None, None]  # ldm's attention projections are 1x1 convolutions
        converted[VAE_PREFIX + names[key]] = value
    return converted


def hf_clip_name(key: str) -> str:
    """A Hugging Face CLIP text weight's full name: transformers 5 drops the `text_model.` wrapper from
    CLIPTextModel, the single-file layout (and transformers 4) keeps it."""
    return key if key.startswith("text_model.") or key.startswith("text_projection") else f"text_model.{key}"


def hf_clip_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face CLIP text weights under their full `text_model.` names; position_ids are not weights."""
    return {hf_clip_name(key): value for key, value in state_dict.items() if not key.endswith("position_ids")}


# OpenCLIP's names of the Hugging Face CLIP text tower's weights (full names, hf_clip_name), per encoder layer.
OPENCLIP_TOP_LEVEL = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
OPENCLIP_LAYER_NAMES = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
FUSED_QKV = "qkv"  # OpenCLIP's attn.in_proj_weight / _bias: q, k and v stacked along the output dimension


def openclip_source(name: str) -> tuple[str, int | None, bool]:
    """Where an OpenCLIP single file keeps the Hugging Face weight `name` (full name): (key without
    CLIP_G_PREFIX, which third of the fused q/k/v tensor or None, stored transposed)."""
    if name in OPENCLIP_TOP_LEVEL:
        return OPENCLIP_TOP_LEVEL[name], None, False
    if name == "text_projection.weight":
        return "text_projection", None, True
    layer, _, rest = name.removeprefix("text_model.encoder.layers.").partition(".")
    module, _, kind = rest.rpartition(".")
    for third, projection in enumerate(FUSED_QKV):
        if module == f"self_attn.{projection}_proj":
            return f"transformer.resblocks.{layer}.attn.in_proj_{kind}", third, False
    return f"transformer.resblocks.{layer}.{OPENCLIP_LAYER_NAMES[module]}.{kind}", None, False


def clip_g_to_openclip(state_dict: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face CLIPTextModelWithProjection -> OpenCLIP text tower names (q/k/v fused into in_proj)."""
    state_dict = hf_clip_names(state_dict)
    out = {OPENCLIP_TOP_LEVEL[name]: state_dict[name] for name in OPENCLIP_TOP_LEVEL}
    out["text_projection"] = state_dict["text_projection.weight"].T.contiguous()
    for layer in range(num_layers):
        source, target = f"text_model.encoder.layers.{layer}.", f"transformer.resblocks.{layer}."
        for kind in ("weight", "bias"):
            out[f"{target}attn.in_proj_{kind}"] = torch.cat([state_dict[f"{source}self_attn.{name}_proj.{kind}"] for name in FUSED_QKV])
            for old, new in OPENCLIP_LAYER_NAMES.items():
                out[f"{target}{new}.{kind}"] = state_dict[f"{source}{old}.{kind}"]
    return {CLIP_G_PREFIX + key: value for key, value in out.items()}


def pipeline_to_single_file(pipeline: StableDiffusionXLPipeline) -> dict[str, torch.Tensor]:
    """The single-file state: every component, the two keys official SDXL files carry beside the weights
    (CLIP-L's position ids, OpenCLIP's logit scale), and the objective markers ComfyUI, Forge and A1111 read
    from the keys (an empty `v_pred` tensor for v-prediction, `ztsnr` for zero terminal SNR: without them a
    v-prediction model is sampled as epsilon)."""
    state = unet_to_ldm(pipeline.unet.state_dict(), dict(pipeline.unet.config))
    state.update(vae_to_ldm(pipeline.vae.state_dict(), dict(pipeline.vae.config)))
    state.update({CLIP_L_PREFIX + key: value for key, value in hf_clip_names(pipeline.text_encoder.state_dict()).items()})
    state.update(clip_g_to_openclip(pipeline.text_encoder_2.state_dict(), pipeline.text_encoder_2.config.num_hidden_layers))
    positions = pipeline.text_encoder.config.max_position_embeddings
    state[CLIP_L_PREFIX + "text_model.embeddings.position_ids"] = torch.arange(positions, dtype=torch.int64)[None]
    state[CLIP_G_PREFIX + "logit_scale"] = torch.tensor(math.log(100.0), dtype=pipeline.text_encoder_2.dtype)  # OpenCLIP's trained value
    scheduler = pipeline.scheduler.config
    if scheduler.get("prediction_type") == "v_prediction":
        state["v_pred"] = torch.tensor([])
    if scheduler.get("rescale_betas_zero_snr"):
        state["ztsnr"] = torch.tensor([])
    return state


def model_spec(pipeline: StableDiffusionXLPipeline, title: str) -> dict[str, str]:
    """Stability's model-spec metadata (as kohya writes it): what the file is, for UIs and model hubs."""
    size = pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    return model_spec_of(title, size, pipeline.scheduler.config.get("prediction_type") == "v_prediction")


def model_spec_of(title: str, resolution: int, v_prediction: bool) -> dict[str, str]:
    """model_spec from the facts it records: a square `resolution` in pixels, the objective."""
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-xl-v1-base",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": title,
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.prediction_type": "v" if v_prediction else "epsilon",
        "modelspec.date": datetime.date.today().isoformat(),
    }


def save_single_file(pipeline: StableDiffusionXLPipeline, output_file: Path, title: str) -> Path:
    """Write the pipeline (in its current dtype) as one file, named `title` in its metadata, and its
    scheduler config beside it: diffusers' from_single_file ignores the `v_pred` / `ztsnr` keys and would
    sample a v-prediction model as epsilon. Via temporary names, so an interrupted export never leaves a
    file that looks complete."""
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = output_file.with_name(f".{output_file.name}.tmp")
    scheduler_file = output_file.with_suffix(".scheduler_config.json")  # pipeline.scheduler_config.json
    tmp_scheduler_file = scheduler_file.with_name(f".{scheduler_file.name}.tmp")
    state = {key: value.contiguous() for key, value in pipeline_to_single_file(pipeline).items()}
    try:
        save_file(state, str(tmp_file), metadata={"format": "pt", **model_spec(pipeline, title), WRITER_KEY: SINGLE_FILE_WRITER})
        make_shareable(tmp_file)
        tmp_scheduler_file.write_text(pipeline.scheduler.to_json_string(), encoding="utf-8")
    except BaseException:
        tmp_file.unlink(missing_ok=True)
        tmp_scheduler_file.unlink(missing_ok=True)
        raise
    tmp_scheduler_file.replace(scheduler_file)
    tmp_file.replace(output_file)
    return output_file


TOKENIZER_FOLDERS = ("tokenizer", "tokenizer_2")


def load_tokenizers(model_name_or_path: str) -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """Both CLIP tokenizers of a diffusers folder or hub id, read once per process (again if a local
    folder's tokenizer files change): each parses SDXL's 3.6 MB vocabulary twice, a noticeable part of a
    second on a CPU, and a run loads its pipeline for every sample grid, export and handoff (a noticeable
    share of the test suite's CPU time went there). Tokenizers only read their vocabulary, so one pair serves every pipeline."""
    folder = Path(model_name_or_path)
    stamp = []
    for name in TOKENIZER_FOLDERS:
        for path in sorted((folder / name).iterdir()) if (folder / name).is_dir() else []:
            stat = path.stat()
            stamp.append((str(path), stat.st_mtime_ns, stat.st_size))
    return _tokenizers(model_name_or_path, tuple(stamp))


@functools.lru_cache(maxsize=4)
def _tokenizers(model_name_or_path: str, files_stamp: tuple) -> tuple[CLIPTokenizer, CLIPTokenizer]:  # noqa: ARG001 - part of the cache key
    from transformers import CLIPTokenizer

    first, second = (CLIPTokenizer.from_pretrained(model_name_or_path, subfolder=name) for name in TOKENIZER_FOLDERS)
    return first, second


def load_pipeline(model_name_or_path: str, single_file_config: str, dtype: torch.dtype, vae_name_or_path: str | None = None) -> StableDiffusionXLPipeline:
    """A diffusers folder or hub id, or a single-file checkpoint described by `single_file_config`; with
    `vae_name_or_path`, that VAE in place of the model's own (the one a cache was encoded with)."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline

    if is_single_file(model_name_or_path):
        pipeline = StableDiffusionXLPipeline.from_single_file(model_name_or_path, config=single_file_config, dtype=dtype)
    else:
        tokenizer, tokenizer_2 = load_tokenizers(model_name_or_path)
        pipeline = StableDiffusionXLPipeline.from_pretrained(model_name_or_path, dtype=dtype, tokenizer=tokenizer, tokenizer_2=tokenizer_2)
    if vae_name_or_path:
        pipeline.vae = AutoencoderKL.from_pretrained(vae_name_or_path, dtype=dtype)
    return pipeline


def load_unet(model_name_or_path: str, single_file_config: str, dtype: torch.dtype = torch.float32) -> UNet2DConditionModel:
    from diffusers import UNet2DConditionModel

    if is_single_file(model_name_or_path):
        return UNet2DConditionModel.from_single_file(model_name_or_path, config=single_file_config, subfolder="unet", dtype=dtype)
    return UNet2DConditionModel.from_pretrained(model_name_or_path, subfolder="unet", dtype=dtype)
