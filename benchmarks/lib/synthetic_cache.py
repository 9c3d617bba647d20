"""A cache of random latents and embeddings, written through the trainer's own cache writer (cache_info.json,
the empty prompt, safetensors shards and their manifest parts), so that the trainer's data path reads it as it
reads a real one: no images, no encoders."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.lib.unets import UNET_CONFIGS
from sdxl_trainer.cache.format import CachedItem, CacheSettings, write_cache_info
from sdxl_trainer.cache.writer import ShardWriter, write_empty_prompt
from sdxl_trainer.models.encoders import TEXT_MAX_LENGTH

SYNTHETIC = "synthetic"  # stands for the pipeline, VAE and fingerprint a real cache records


def write_cache_for_unet(location: str | Path, model: str, resolution: int, items: int, items_per_shard: int = 128) -> None:
    """`items` items of seeded random tensors, `items_per_shard` to a shard, in one square bucket of `resolution`
    px, shaped for UNET_CONFIGS[model]: its latent channels, its caption embeddings' and pooled embeddings' widths."""
    config = UNET_CONFIGS[model]
    text_width = config["cross_attention_dim"]
    pooled_width = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    latent_shape = (config["in_channels"], resolution // 8, resolution // 8)
    write_cache_info(location, CacheSettings(
        pretrained_model_name_or_path=SYNTHETIC, vae_name_or_path=SYNTHETIC, model_fingerprint=SYNTHETIC, min_resolution=resolution,
        max_resolution=resolution, bucket_table_version=1, latent_scaling_factor=0.13025, text_max_length=TEXT_MAX_LENGTH,
    ))  # fmt: skip
    write_empty_prompt(location, torch.zeros(TEXT_MAX_LENGTH, text_width), torch.zeros(pooled_width))
    writer = ShardWriter(location, "w0")
    generator = torch.Generator().manual_seed(0)
    for first in range(0, items, items_per_shard):
        writer.write([
            CachedItem(
                latents=torch.randn(latent_shape, generator=generator), prompt_embeds=torch.randn(TEXT_MAX_LENGTH, text_width, generator=generator),
                pooled_prompt_embeds=torch.randn(pooled_width, generator=generator),
                row=dict(image_path=f"{index}.jpg", image_sha256="0" * 64, caption="c", bucket_width=resolution, bucket_height=resolution,
                         original_width=resolution, original_height=resolution, crop_top=0, crop_left=0, crop_left_flipped=None, upscaled=False,
                         has_loss_mask=None, mask_sha256=None),
            )
            for index in range(first, min(first + items_per_shard, items))
        ])  # fmt: skip
