"""A LoRA from a fine-tune: each layer's weight change (tuned - base) factored into its best low-rank pair,
written in the kohya / A1111 LoRA layout, which diffusers' `load_lora_weights`, ComfyUI, A1111/Forge and
kohya's scripts load.

Memory and time: the two models are read one weight at a time from their files (models/weight_files.py), so
a full-size SDXL pair needs a few hundred MB besides the LoRA, whatever the files' dtype; a layer the
fine-tune left unchanged (its tuned weights equal the base's rounded to the coarser of the two stored dtypes,
exactly: what an fp16 export of an untouched fp32 weight gives) gets no key and costs no factorisation.

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

A text encoder's attention layer goes into the file whole: where only some of its q/k/v/out projections
changed, the others get zero factors (adding exactly 0). Loaders apply a partial one badly: diffusers converts
a text encoder's q/k/v keys only when an out_proj key is there (with an MLP key but no out_proj it drops q/k/v
with a warning; with q/k/v alone load_lora_weights raises ValueError), and A1111 applies OpenCLIP-G's
attention (one nn.MultiheadAttention, q/k/v fused) only when q, k, v and out_proj are all there. kohya and
ComfyUI apply each key on its own, zeros included.

Names: a UNet layer's name in the original (ldm/sgm) layout with dots as underscores after `lora_unet_`
(single_file.py's map: `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`); a text-encoder
layer's Hugging Face name after `lora_te1_` (CLIP ViT-L) or `lora_te2_` (OpenCLIP bigG):
`lora_te1_text_model_encoder_layers_0_self_attn_q_proj`. Per layer `.lora_down.weight` (r, in[, kh, kw]),
`.lora_up.weight` (out, r[, 1, 1]) and `.alpha` = r, so the loaders' scale alpha / r is 1 and
up @ down is the weight change's best rank-r approximation (Eckart-Young). The leading singular directions
come from the eigenvectors of the change's smaller Gram matrix, in float64 (exact to well below float32's
precision for them, and several times faster than a full SVD: a 10240 x 1280 layer is a 1280 x 1280
eigenproblem); the singular values are split evenly between the factors (sqrt into each), so neither factor
carries the whole scale. Unlike kohya's extractor nothing is clipped (it clamps the factors at their 99%
quantile), so the approximation error only falls as the rank grows, down to float rounding at full rank. A
layer's rank is capped at its full rank, min(out, in x kh x kw).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sdxl_trainer.models.components import TEXT_ENCODER_NAMES
from sdxl_trainer.models.single_file import hf_clip_name, model_spec_of, unet_ldm_names
from sdxl_trainer.models.weight_files import COMPONENTS, ModelFilesError, ModelWeights, StoredWeight
from sdxl_trainer.runtime.files import make_shareable
from sdxl_trainer.runtime.tensor_files import WRITER_KEY

UNET_ATTENTION_BLOCKS = ("Transformer2DModel",)
UNET_CONV_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_BLOCKS = ("CLIPAttention", "CLIPMLP")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")  # a text encoder's attention layer (CLIPAttention)
TEXT_ENCODER_PREFIXES = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
LORA_COMPONENTS = ("unet", *TEXT_ENCODER_PREFIXES)
KOHYA_SDXL_VERSION = "sdxl_base_v1-0"  # kohya's ss_base_model_version for SDXL
LORA_WRITER = "lora"  # the WRITER_KEY mark of an extracted LoRA
# Two models with independent weights of equal spread differ by sqrt(2) = 141% of a layer's norm (as the tiny
# pipelines of two seeds do); a fine-tune starts at 0% and moves its layers gradually. More than
# UNRELATED_SHARE of the UNet's LoRA layers changed by more than LARGE_CHANGE: the tuned model was most
# likely not fine-tuned from this base.
LARGE_CHANGE = 0.5
UNRELATED_SHARE = 0.5


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
    its squared Frobenius norm the approximation holds (1 for a zero change). Computed in float64 on
    delta's device, returned in float32."""
    matrix = delta.reshape(delta.shape[0], -1).double()
    r = min(rank, *matrix.shape)
    tall = matrix.shape[0] >= matrix.shape[1]
    gram = matrix.T @ matrix if tall else matrix @ matrix.T
    directions = torch.linalg.eigh(gram).eigenvectors[:, -r:].flip(1)  # the r leading ones (eigh sorts ascending)
    projected = matrix @ directions if tall else directions.T @ matrix  # U S (out x r), or S V^T (r x in)
    singular = projected.norm(dim=0 if tall else 1)  # measured, so up @ down is exactly the projection of delta
    root = torch.where(singular > 0, singular.sqrt(), torch.ones_like(singular))
    up, down = (projected / root, root[:, None] * directions.T) if tall else (directions * root, projected / root[:, None])
    total = float(matrix.square().sum())
    kept = min(float(singular.square().sum()) / total, 1.0) if total > 0 else 1.0
    if delta.ndim == 4:
        up, down = up.reshape(delta.shape[0], r, 1, 1), down.reshape(r, *delta.shape[1:])
    return up.float(), down.float(), kept


@dataclass
class ComponentReport:
    layers: int = 0  # changed layers, factored into the file
    skipped: int = 0  # unchanged (no key)
    padded: int = 0  # unchanged attention projections written as zero factors, so that each attention layer is whole
    energy: float = 0.0  # squared Frobenius norm of the weight changes of its LoRA layers
    kept_energy: float = 0.0  # ... of their low-rank approximations
    relative_changes: list[float] = field(default_factory=list)  # per LoRA layer: |change| / |base weight| (Frobenius)

    @property
    def kept(self) -> float:
        return self.kept_energy / self.energy if self.energy > 0 else 1.0

    @property
    def large_changes(self) -> int:
        return sum(change > LARGE_CHANGE for change in self.relative_changes)


@dataclass
class LoraExtraction:
    tensors: dict[str, torch.Tensor]  # the file's tensors, kohya layout
    components: dict[str, ComponentReport]  # "unet", "text_encoder", "text_encoder_2": only those in the file
    skipped_text_encoders: dict[str, float] = field(default_factory=dict)  # name -> its largest change (<= min_diff)
    left_out: list[tuple[str, float]] = field(default_factory=list)  # the largest changes outside the LoRA: (weight, max |change|)
    compared_in: set[str] = field(default_factory=set)  # the dtypes unchanged layers were compared in ("float16")

    def unrelated_base(self) -> str | None:
        """Why the tuned model looks like no fine-tune of the base (None if it does): LARGE_CHANGE's criterion."""
        changes = self.components["unet"].relative_changes if "unet" in self.components else []
        large = sum(change > LARGE_CHANGE for change in changes)
        if not changes or large <= UNRELATED_SHARE * len(changes):
            return None
        return (
            f"{large} of {len(changes)} UNet layers changed by more than {LARGE_CHANGE:.0%} of their weights' norm (median "
            f"{statistics.median(changes):.0%}; two models with independent weights of equal spread differ by sqrt(2) = 141%)"
        )


def architecture_problem(base: ModelWeights, tuned: ModelWeights) -> str | None:
    """Why the two models cannot be subtracted (None if they can): a component whose weights differ in names or shapes."""
    for component in LORA_COMPONENTS:
        base_shapes = {name: weight.shape for name, weight in base.weights[component].items()}
        tuned_shapes = {name: weight.shape for name, weight in tuned.weights[component].items()}
        if base_shapes != tuned_shapes:
            differing = sorted(name for name in base_shapes.keys() | tuned_shapes.keys() if base_shapes.get(name) != tuned_shapes.get(name))
            example = differing[0]
            return (
                f"the base and the tuned model's {component} have different architectures ({len(differing)} weights differ, e.g. {example}: "
                f"{list(base_shapes[example]) if example in base_shapes else 'absent'} in the base, "
                f"{list(tuned_shapes[example]) if example in tuned_shapes else 'absent'} in the tuned model): a LoRA needs a fine-tune of the base"
            )
    return None


def rounding_free_change(base: torch.Tensor, tuned: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """tuned - base compared in the coarser of the two dtypes (the tuned one where both are as wide), so an
    export's rounding alone is no change; and that dtype."""
    coarse = tuned.dtype if tuned.dtype.itemsize <= base.dtype.itemsize else base.dtype
    return tuned.to(coarse).float() - base.to(coarse).float(), coarse


def _lora_layers(base: ModelWeights, component: str, conv_rank: int) -> dict[str, str]:
    """Weight name -> LoRA key prefix of every layer of `component` a LoRA carries (module docstring)."""
    if component == "unet":
        layers = target_layers(base.module("unet"), UNET_ATTENTION_BLOCKS + (UNET_CONV_BLOCKS if conv_rank > 0 else ()))
        ldm_names = unet_ldm_names([f"{name}.weight" for name in layers], base.configs["unet"])
        return {f"{name}.weight": "lora_unet_" + ldm_names[f"{name}.weight"].removesuffix(".weight").replace(".", "_") for name in layers}
    # CLIPTextModel (transformers 5) has no text_model. wrapper; kohya's names keep it
    layers = target_layers(base.module(component), TEXT_ENCODER_BLOCKS)
    return {hf_clip_name(f"{name}.weight"): TEXT_ENCODER_PREFIXES[component] + hf_clip_name(name).replace(".", "_") for name in layers}


def _file_order(weights: dict[str, StoredWeight]) -> list[str]:
    """Weight names in the order their bytes lie in the files: reads go front to back."""
    return sorted(weights, key=lambda name: (str(weights[name].file.path), weights[name].file.entries[weights[name].key].start))


def extract_lora(
    base: ModelWeights,
    tuned: ModelWeights,
    rank: int,
    conv_rank: int = 0,
    min_diff: float = 0.01,
    dtype: torch.dtype = torch.float16,
    device: torch.device = torch.device("cpu"),
    progress: bool = False,
) -> LoraExtraction:
    """The LoRA of `tuned` - `base` (module docstring): one weight of each model in memory at a time, the
    factorisations on `device`, unchanged layers skipped."""
    extraction = LoraExtraction({}, {})
    left_out = []
    for component in COMPONENTS:
        base_weights, tuned_weights = base.weights[component], tuned.weights[component]
        lora_layers = _lora_layers(base, component, conv_rank) if component in LORA_COMPONENTS else {}
        absent = [name for name in lora_layers if name not in base_weights or name not in tuned_weights]
        if absent:
            raise ModelFilesError(f"the {component} weights of {len(absent)} layers its config describes are not in the files (e.g. {absent[0]})")
        if component in TEXT_ENCODER_NAMES:  # kohya's rule: a text encoder only where it was trained, not merely rounded
            largest = max((float(rounding_free_change(base_weights[name].read(), tuned_weights[name].read())[0].abs().max()) for name in lora_layers), default=0.0)
            if largest <= min_diff:
                extraction.skipped_text_encoders[component] = largest
                lora_layers = {}
        if lora_layers:
            report = extraction.components[component] = ComponentReport()
        names = [name for name in _file_order(base_weights) if name in tuned_weights]
        for name in tqdm(names, desc=f"{component}", unit="weight", disable=None if progress else True, leave=False):
            base_tensor, tuned_tensor = base_weights[name].read(), tuned_weights[name].read()
            change, compared_in = rounding_free_change(base_tensor, tuned_tensor)
            largest = float(change.abs().max()) if change.numel() else 0.0
            if name not in lora_layers:
                if largest > 0:
                    left_out.append((f"{component}.{name}", largest))
                continue
            delta = tuned_tensor.float() - base_tensor.float()
            base_norm = float(base_tensor.float().norm())
            report.relative_changes.append(float(delta.norm()) / base_norm if base_norm > 0 else 0.0)
            if largest == 0:
                report.skipped += 1
                extraction.compared_in.add(str(compared_in).removeprefix("torch."))
                continue
            layer_rank = conv_rank if delta.ndim == 4 and delta.shape[2:] != (1, 1) else rank
            up, down, kept = low_rank_factors(delta.to(device), layer_rank)
            lora_name = lora_layers[name]
            extraction.tensors[f"{lora_name}.lora_up.weight"] = up.to("cpu", dtype).contiguous()
            extraction.tensors[f"{lora_name}.lora_down.weight"] = down.to("cpu", dtype).contiguous()
            extraction.tensors[f"{lora_name}.alpha"] = torch.tensor(float(down.shape[0]), dtype=dtype)
            energy = float(delta.double().square().sum())
            report.layers += 1
            report.energy += energy
            report.kept_energy += kept * energy
        if component in TEXT_ENCODER_NAMES and lora_layers:
            report.padded = _complete_attention_layers(extraction.tensors, lora_layers, base_weights, dtype)
    extraction.left_out = sorted(left_out, key=lambda item: -item[1])[:5]
    return extraction


def _complete_attention_layers(tensors: dict[str, torch.Tensor], lora_layers: dict[str, str], base_weights: dict[str, StoredWeight],
                               dtype: torch.dtype) -> int:
    """Give every attention layer of a text encoder that has some of its q/k/v/out projections in `tensors` the
    others as zero factors of the same rank (module docstring: why). Returns how many were added."""
    attention_layers: dict[str, list[str]] = {}  # attention module -> its projections' weight names
    for name in lora_layers:
        attention, _, projection = name.removesuffix(".weight").rpartition(".")
        if projection in ATTENTION_PROJECTIONS:
            attention_layers.setdefault(attention, []).append(name)
    added = 0
    for names in attention_layers.values():
        present = [lora_layers[name] for name in names if f"{lora_layers[name]}.lora_down.weight" in tensors]
        if not present:
            continue
        rank = tensors[f"{present[0]}.lora_down.weight"].shape[0]
        for name in names:
            prefix = lora_layers[name]
            if f"{prefix}.lora_down.weight" not in tensors:
                out_features, in_features = base_weights[name].shape
                tensors[f"{prefix}.lora_up.weight"] = torch.zeros(out_features, rank, dtype=dtype)
                tensors[f"{prefix}.lora_down.weight"] = torch.zeros(rank, in_features, dtype=dtype)
                tensors[f"{prefix}.alpha"] = torch.tensor(float(rank), dtype=dtype)
                added += 1
    return added


def lora_metadata(tuned: ModelWeights, rank: int, conv_rank: int, title: str) -> dict[str, str]:
    """The metadata kohya's extractor writes: its ss_* network description and Stability's model spec."""
    network_args = {"conv_dim": str(conv_rank), "conv_alpha": str(float(conv_rank))} if conv_rank > 0 else {}
    spec = model_spec_of(title, tuned.resolution, tuned.v_prediction)
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
        WRITER_KEY: LORA_WRITER,
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
