"""SDXL's published architecture: the configs of the full-size UNet, VAE, text encoders and scheduler,
CLIP's tokenizers built offline, and random-weight full-size models (benchmarks, --estimate_memory).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the published architecture).
SDXL_UNET_CONFIG = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    norm_num_groups=32,
)

# SDXL's UNet at a width a CPU trains in a second: every block, layer and parameter tensor of the published
# architecture (1,680 tensors) at the tiny pipeline's widths (its text encoders' 32 + 48 channels, 8-wide time
# ids), so it trains on the tiny pipeline's caches. What does not depend on the width (the operators an update
# dispatches, its tensors, its collectives' calls) is SDXL's.
NARROW_SDXL_UNET_CONFIG = {
    **SDXL_UNET_CONFIG,
    "block_out_channels": (32, 64, 128),
    "attention_head_dim": (1, 2, 4),
    "cross_attention_dim": 32 + 48,
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 48 + 6 * 8,  # the pooled caption embedding, then 6 size ids
}


# stabilityai/stable-diffusion-xl-base-1.0 vae/config.json (the published architecture).
SDXL_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.13025,
)


# stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json
SDXL_SCHEDULER_CONFIG = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    steps_offset=1,
    timestep_spacing="leading",
    interpolation_type="linear",
    use_karras_sigmas=False,
)


# SDXL's two text encoders: OpenAI CLIP ViT-L/14's text tower and OpenCLIP ViT-bigG/14's (published configs).
SDXL_TEXT_ENCODER_CONFIGS = (
    dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu"),
    dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, projection_dim=1280, hidden_act="gelu"),
)


def _bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible byte -> printable-character map (the alphabet of its byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters)))


def clip_bpe_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary and BPE merges, derived from the BPE file that open_clip ships (found without
    importing open_clip, which pulls in timm and wandb: seconds of every tiny pipeline and memory estimate)."""
    open_clip = importlib.util.find_spec("open_clip")
    if open_clip is None:
        raise ModuleNotFoundError("CLIP's BPE vocabulary comes with open_clip_torch: pip install -r requirements.txt")
    bpe_path = Path(open_clip.submodule_search_locations[0]) / "bpe_simple_vocab_16e6.txt.gz"
    merge_lines = gzip.open(bpe_path, "rt", encoding="utf-8").read().split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(line.split()) for line in merge_lines]
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [character + "</w>" for character in alphabet] + ["".join(merge) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def sdxl_tokenizers() -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """SDXL's two tokenizers (CLIP's vocabulary) made locally: tokenizer 1 pads with <|endoftext|>,
    tokenizer 2 (OpenCLIP bigG's) with "!"."""
    vocab, merges = clip_bpe_vocabulary()
    first, second = (CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=TEXT_MAX_LENGTH) for pad_token in ("<|endoftext|>", "!"))
    return first, second


def build_full_size_vae() -> AutoencoderKL:
    """SDXL's VAE architecture with random weights, for benchmarks without downloads."""
    return AutoencoderKL(**SDXL_VAE_CONFIG)


def build_full_size_text_encoders() -> tuple[CLIPTextModel, CLIPTextModelWithProjection]:
    """SDXL's two text encoders at full size (123 M and 695 M parameters) with random weights."""
    first, second = (CLIPTextConfig(vocab_size=49408, max_position_embeddings=TEXT_MAX_LENGTH, **config) for config in SDXL_TEXT_ENCODER_CONFIGS)
    return CLIPTextModel(first), CLIPTextModelWithProjection(second)


def build_full_size_unet() -> UNet2DConditionModel:
    """The full-size SDXL UNet (2.57 B parameters) with random weights, for benchmarks without downloads."""
    return UNet2DConditionModel(**SDXL_UNET_CONFIG)
