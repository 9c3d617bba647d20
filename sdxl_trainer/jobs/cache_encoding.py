"""Prepared items -> cached items: images through the VAE by bucket, captions through both text encoders.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from sdxl_trainer.cache.format import CachedItem, CacheSettings, captions_in
from sdxl_trainer.models.encoders import TOKENS_PER_CHUNK, Encoders
from sdxl_trainer.preparation.items import PreparedItem


def truncation_advice(max_token_length: int) -> str:
    longer = [length for length in (150, 225) if length > max_token_length]
    return f"raise --max_token_length ({' or '.join(map(str, longer))}) or shorten the caption" if longer else "shorten the caption"


def encode_chunk(
    encoders: Encoders, prepared: list[PreparedItem], batch_size: int, caption_chunks: int, settings: CacheSettings
) -> tuple[list[CachedItem], dict[str, int]]:
    """Encode images grouped by bucket (one VAE call needs one size), with --flip_aug their mirrors too, and each
    item's first caption (framed by the cache's caption prefix and suffix), in batches. Also returns the items
    whose caption was cut (relative path -> its token count)."""
    by_bucket: dict[tuple[int, int], list[PreparedItem]] = defaultdict(list)
    for item in prepared:
        by_bucket[(item.plan.bucket.width, item.plan.bucket.height)].append(item)
    cached = []
    truncated = {}
    for items in by_bucket.values():
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            pixels = torch.stack([item.pixels for item in batch])
            latents = encoders.encode_images(pixels)
            flipped = encoders.encode_images(torch.flip(pixels, dims=[-1])) if settings.flip_aug else None
            captions = encoders.encode_captions([settings.framed(captions_in(item.caption)[0]) for item in batch], caption_chunks)
            for index, item in enumerate(batch):
                cached.append(
                    CachedItem(
                        latents[index], captions.prompt_embeds[index], captions.pooled_prompt_embeds[index], item.manifest_row(),
                        None if flipped is None else flipped[index], item.loss_mask,
                    )
                )
                if captions.token_counts[index] > caption_chunks * TOKENS_PER_CHUNK:
                    truncated[item.source.relative_path] = captions.token_counts[index]
    return cached, truncated
