"""Cached items made for a test: random tensors under the cache settings the cache tests use.
"""

from __future__ import annotations

import torch

from sdxl_trainer.cache.format import CachedItem, CacheSettings

SETTINGS = CacheSettings(
    pretrained_model_name_or_path="some/sdxl",
    vae_name_or_path="some/sdxl",
    model_fingerprint="abc123",
    min_resolution=512,
    max_resolution=1024,
    bucket_table_version=1,
    latent_scaling_factor=0.13025,
    text_max_length=77,
)


def make_item(image_path: str, seed: int, caption: str = "a caption") -> CachedItem:
    generator = torch.Generator().manual_seed(seed)
    return CachedItem(
        latents=torch.randn(4, 8, 12, generator=generator),
        prompt_embeds=torch.randn(77, 64, generator=generator),
        pooled_prompt_embeds=torch.randn(32, generator=generator),
        row={
            "image_path": image_path,
            "image_sha256": f"{seed:064x}",
            "caption": caption,
            "bucket_width": 96,
            "bucket_height": 64,
            "original_width": 100 + seed,
            "original_height": 70 + seed,
            "crop_top": seed % 3,
            "crop_left": seed % 5,
            "upscaled": False,
        },
    )
