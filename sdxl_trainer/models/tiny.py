"""A random-initialised SDXL pipeline in small sizes, for the tests and the quickstart: the same
architecture and files as stabilityai/stable-diffusion-xl-base-1.0, loaded through the same code.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH
from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, sdxl_tokenizers
from sdxl_trainer.runtime.quiet_libraries import hide_library_progress_bars

# The same architecture with every width and depth cut down. The two text encoders differ in width, as
# SDXL's do (CLIP ViT-L 768, OpenCLIP bigG 1280), so code that tells them apart by shape is exercised:
# 32 + 48 = 80 cross-attention channels; pooled projection 48 + 6 time ids x 8 = 96 wide additional embedding.
TINY_TEXT_WIDTHS = (32, 48)


TINY_TIME_EMBED_DIM = 8


TINY_UNET_CONFIG = dict(
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    transformer_layers_per_block=(1, 1),
    attention_head_dim=(2, 4),
    cross_attention_dim=sum(TINY_TEXT_WIDTHS),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=TINY_TIME_EMBED_DIM,
    projection_class_embeddings_input_dim=TINY_TEXT_WIDTHS[1] + 6 * TINY_TIME_EMBED_DIM,
    norm_num_groups=16,
)


TINY_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(16, 16, 32, 32),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=16,
    sample_size=256,
    scaling_factor=0.13025,  # SDXL's
)


def build_tiny_pipeline(seed: int = 0) -> StableDiffusionXLPipeline:
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = sdxl_tokenizers()
    text_encoder, text_encoder_2 = build_tiny_text_encoders(tokenizer)
    return StableDiffusionXLPipeline(
        vae=AutoencoderKL(**TINY_VAE_CONFIG),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=UNet2DConditionModel(**TINY_UNET_CONFIG),
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
    )


def build_tiny_text_encoders(tokenizer: CLIPTokenizer | None = None) -> tuple[CLIPTextModel, CLIPTextModelWithProjection]:
    """The tiny pipeline's two text encoders (random weights), sized for `tokenizer`'s vocabulary."""
    tokenizer = tokenizer or sdxl_tokenizers()[0]
    text_configs = [
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=TEXT_MAX_LENGTH,
            projection_dim=width,
            hidden_act=activation,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for width, activation in zip(TINY_TEXT_WIDTHS, ("quick_gelu", "gelu"))
    ]
    return CLIPTextModel(text_configs[0]), CLIPTextModelWithProjection(text_configs[1])


def save_tiny_pipeline(output_dir: Path, seed: int = 0) -> Path:
    build_tiny_pipeline(seed).save_pretrained(output_dir)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path, help="folder to write the diffusers pipeline into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args()
    hide_library_progress_bars()
    save_tiny_pipeline(args.output_dir, args.seed)
    print(f"Tiny SDXL pipeline written to {args.output_dir}")


if __name__ == "__main__":
    main()
