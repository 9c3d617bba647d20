"""A LoRA from a fine-tune: each layer's weight change (tuned - base) factored by SVD into a low-rank pair,
written in the kohya / A1111 LoRA layout, which diffusers' `load_lora_weights`, ComfyUI, A1111/Forge and
kohya's scripts load.

Layers (kohya's `networks.lora` choice, so every loader that knows kohya files finds each key):
- UNet, always: every Linear and Conv2d inside the transformer blocks (Transformer2DModel): proj_in,
  proj_out, the query/key/value/output projections of self- and cross-attention, the feed-forward layers.
- UNet, with conv_rank > 0 (kohya's conv_dim): also the ResNet blocks (conv1 and conv2 are 3x3 and get
  conv_rank; time_emb_proj (Linear) and conv_shortcut (1x1) get rank) and the down- and upsampler
  convolutions (3x3, conv_rank).
- Text encoders, each only where it changed (its largest weight change in these layers above min_diff):
  the q/k/v/out projections and both MLP layers of every encoder layer.
- Never: norms, biases, embeddings, conv_in / conv_out and the time / added-condition embeddings, which
  kohya's LoRA has no keys for. `LoraExtraction.left_out` reports the largest change the file cannot carry.

Names: a UNet layer's name in the original (ldm/sgm) layout with dots as underscores after `lora_unet_`
(single_file.py's map: `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`); a text-encoder
layer's Hugging Face name after `lora_te1_` (CLIP ViT-L) or `lora_te2_` (OpenCLIP bigG):
`lora_te1_text_model_encoder_layers_0_self_attn_q_proj`. Per layer `.lora_down.weight` (r, in[, kh, kw]),
`.lora_up.weight` (out, r[, 1, 1]) and `.alpha` = r, so the loaders' scale alpha / r is 1 and
up @ down is the weight change's best rank-r approximation (Eckart-Young). The singular values are split
evenly between the factors (sqrt into each), so neither factor carries the whole scale. Unlike kohya's
extractor nothing is clipped (it clamps the factors at their 99% quantile), so the approximation error
only falls as the rank grows, down to float rounding at full rank. A layer's rank is capped at its full
rank, min(out, in x kh x kw).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import StableDiffusionXLPipeline
from safetensors.torch import save_file

from sdxl_trainer.models.single_file import model_spec, unet_ldm_names
from sdxl_trainer.runtime.files import make_shareable

UNET_ATTENTION_BLOCKS = ("Transformer2DModel",)
UNET_CONV_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_BLOCKS = ("CLIPAttention", "CLIPMLP")
TEXT_ENCODER_PREFIXES = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
KOHYA_SDXL_VERSION = "sdxl_base_v1-0"  # kohya's ss_base_model_version for SDXL


def target_layers(model: torch.nn.Module, block_types: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """Module name -> every Linear or Conv2d inside a module of one of `block_types` (by class name, as kohya
    selects them), in the model's order."""
    layers = {}
    for block_name, block in model.named_modules():
        if type(block).__name__ in block_types:
            for name, layer in block.named_modules():
                if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                    layers[f"{block_name}.{name}"] = layer
    return layers


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A weight change (out, in) or (out, in, kh, kw) -> (up, down, kept): up (out, r[, 1, 1]) @ down
    (r, in[, kh, kw]) is its best rank-r approximation, r = min(rank, full rank); `kept` is the share of
    its squared Frobenius norm the approximation holds (1 for a zero change). Computed in fp32."""
    matrix = delta.reshape(delta.shape[0], -1).float()
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    up, down = u[:, :r] * root, root[:, None] * vh[:r]
    total = float((s**2).sum())
    kept = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    if delta.ndim == 4:
        up, down = up.reshape(delta.shape[0], r, 1, 1), down.reshape(r, *delta.shape[1:])
    return up, down, kept


@dataclass
class ComponentReport:
    layers: int = 0
    energy: float = 0.0  # squared Frobenius norm of the weight changes of its LoRA layers
    kept_energy: float = 0.0  # ... of their low-rank approximations

    @property
    def kept(self) -> float:
        return self.kept_energy / self.energy if self.energy > 0 else 1.0


@dataclass
class LoraExtraction:
    tensors: dict[str, torch.Tensor]  # the file's tensors, kohya layout
    components: dict[str, ComponentReport]  # "unet", "text_encoder", "text_encoder_2": only those in the file
    skipped_text_encoders: dict[str, float] = field(default_factory=dict)  # name -> its largest change (<= min_diff)
    left_out: list[tuple[str, float]] = field(default_factory=list)  # the largest changes outside the LoRA: (weight, max |change|)


def architecture_problem(base: StableDiffusionXLPipeline, tuned: StableDiffusionXLPipeline) -> str | None:
    """Why the two models cannot be subtracted (None if they can): a component whose weights differ in names or shapes."""
    for component in ("unet", *TEXT_ENCODER_PREFIXES, "vae"):
        base_shapes = {key: value.shape for key, value in getattr(base, component).state_dict().items()}
        tuned_shapes = {key: value.shape for key, value in getattr(tuned, component).state_dict().items()}
        if base_shapes != tuned_shapes:
            return f"the base and the tuned model's {component} have different architectures (weight names or shapes): a LoRA needs a fine-tune of the base"
    return None


def _largest_changes_outside(base: torch.nn.Module, tuned: torch.nn.Module, component: str, covered: set[str], count: int = 5) -> list[tuple[str, float]]:
    tuned_state = tuned.state_dict()
    changes = []
    for key, value in base.state_dict().items():
        if key not in covered and value.is_floating_point():
            change = float((tuned_state[key].float() - value.float()).abs().max()) if value.numel() else 0.0
            if change > 0:
                changes.append((f"{component}.{key}", change))
    return sorted(changes, key=lambda item: -item[1])[:count]


def extract_lora(
    base: StableDiffusionXLPipeline,
    tuned: StableDiffusionXLPipeline,
    rank: int,
    conv_rank: int = 0,
    min_diff: float = 0.01,
    dtype: torch.dtype = torch.float16,
    device: torch.device = torch.device("cpu"),
) -> LoraExtraction:
    """The LoRA of `tuned` - `base` (module docstring); the SVDs run on `device`, one layer at a time."""
    unet_blocks = UNET_ATTENTION_BLOCKS + (UNET_CONV_BLOCKS if conv_rank > 0 else ())
    plans = {"unet": target_layers(base.unet, unet_blocks)}
    for name in TEXT_ENCODER_PREFIXES:
        plans[name] = target_layers(getattr(base, name), TEXT_ENCODER_BLOCKS)
    ldm_names = unet_ldm_names([f"{name}.weight" for name in plans["unet"]], dict(base.unet.config))
    extraction = LoraExtraction({}, {})
    for component, layers in plans.items():
        tuned_layers = dict(getattr(tuned, component).named_modules())

        def change(name: str) -> torch.Tensor:  # one layer at a time: no second copy of the model
            return tuned_layers[name].weight.detach().float() - layers[name].weight.detach().float()

        if component != "unet":
            largest = max((float(change(name).abs().max()) for name in layers), default=0.0)
            if largest <= min_diff:
                extraction.skipped_text_encoders[component] = largest
                continue
        report = extraction.components[component] = ComponentReport()
        for name in layers:
            delta = change(name).to(device)
            if component == "unet":
                lora_name = "lora_unet_" + ldm_names[f"{name}.weight"].removesuffix(".weight").replace(".", "_")
            else:  # CLIPTextModel (transformers 5) has no text_model. wrapper; kohya's names keep it
                lora_name = TEXT_ENCODER_PREFIXES[component] + (name if name.startswith("text_model.") else f"text_model.{name}").replace(".", "_")
            layer_rank = conv_rank if delta.ndim == 4 and delta.shape[2:] != (1, 1) else rank
            up, down, kept = low_rank_factors(delta, layer_rank)
            extraction.tensors[f"{lora_name}.lora_up.weight"] = up.to("cpu", dtype).contiguous()
            extraction.tensors[f"{lora_name}.lora_down.weight"] = down.to("cpu", dtype).contiguous()
            extraction.tensors[f"{lora_name}.alpha"] = torch.tensor(float(down.shape[0]), dtype=dtype)
            energy = float(delta.square().sum())
            report.layers += 1
            report.energy += energy
            report.kept_energy += kept * energy
    for component, layers in plans.items():
        covered = {f"{name}.weight" for name in layers} if component in extraction.components else set()
        extraction.left_out += _largest_changes_outside(getattr(base, component), getattr(tuned, component), component, covered)
    extraction.left_out += _largest_changes_outside(base.vae, tuned.vae, "vae", set())
    extraction.left_out = sorted(extraction.left_out, key=lambda item: -item[1])[:5]
    return extraction


def lora_metadata(tuned: StableDiffusionXLPipeline, rank: int, conv_rank: int, title: str) -> dict[str, str]:
    """The metadata kohya's extractor writes: its ss_* network description and Stability's model spec."""
    network_args = {"conv_dim": str(conv_rank), "conv_alpha": str(float(conv_rank))} if conv_rank > 0 else {}
    spec = model_spec(tuned, title)
    spec["modelspec.architecture"] += "/lora"
    return {
        "format": "pt",
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(float(rank)),
        "ss_network_args": json.dumps(network_args),
        "ss_base_model_version": KOHYA_SDXL_VERSION,
        "ss_v2": "False",
        **spec,
    }


def save_lora(extraction: LoraExtraction, metadata: dict[str, str], output_file: Path) -> None:
    """Write the LoRA via a temporary name, so an interrupted write never leaves a file that looks complete."""
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = output_file.with_name(f".{output_file.name}.tmp")
    try:
        save_file(extraction.tensors, str(tmp_file), metadata=metadata)
        make_shareable(tmp_file)
    except BaseException:
        tmp_file.unlink(missing_ok=True)
        raise
    tmp_file.replace(output_file)
