"""Generating images on every rank with the trained (possibly FSDP-sharded) UNet, and gathering results.

With FSDP every UNet forward is a collective (each block's weights are all-gathered), so all ranks must
make the same number of UNet calls: each rank generates its own share of the requests in batches of one
image size, step count and guidance scale. How many UNet forwards a pipeline call makes depends only on
its step count (one per scheduler timestep, whatever the size, batch or guidance), so the ranks agree on
the number of calls per step count (the busiest rank's), go through the step counts in ascending order,
and a rank with fewer calls of a step count runs small dummy generations of that many steps (discarded). Each image's starting noise comes from its own seed (a CPU
generator per image), so an image does not depend on the rank, batch or process count it was made in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline

DUMMY_SIZE = 64  # px; the smallest image every SDXL-shaped UNet accepts (8x8 latents)
MAX_STEPS = 1000  # inference steps per image at most (the noise schedule's training timesteps)


@dataclass(frozen=True)
class ImageRequest:
    key: int  # names the image in the results (an item index, or a prompt's position)
    prompt_embeds: torch.Tensor  # (77, 2048) as cached
    pooled_prompt_embeds: torch.Tensor  # (1280,)
    width: int  # px, multiples of 8
    height: int
    seed: int  # of this image's starting noise
    num_inference_steps: int | None = None  # None: GenerationSettings'
    guidance_scale: float | None = None  # None: GenerationSettings'
    negative: tuple[torch.Tensor, torch.Tensor] | None = None  # (prompt_embeds, pooled) to guide away from; None: generate()'s


@dataclass(frozen=True)
class GenerationSettings:
    num_inference_steps: int = 30
    guidance_scale: float = 5.0  # classifier-free guidance against the negative (empty-caption) embeddings
    batch_size: int = 4  # images of one size per pipeline call


def rank_share(requests: list, rank: int, world_size: int) -> list:
    """This rank's share of a list every rank holds in the same order (round robin)."""
    return requests[rank::world_size]


def _batches_by_steps(requests: list[ImageRequest], batch_size: int) -> dict[int, list[list[ImageRequest]]]:
    """Step count -> this rank's pipeline calls of that many steps; each call one size and guidance scale."""
    groups: dict[tuple, list[ImageRequest]] = defaultdict(list)
    for request in requests:
        groups[(request.num_inference_steps, request.guidance_scale, request.width, request.height)].append(request)
    by_steps: dict[int, list[list[ImageRequest]]] = defaultdict(list)
    for (steps, *_), group in sorted(groups.items()):
        by_steps[steps] += [group[start : start + batch_size] for start in range(0, len(group), batch_size)]
    return by_steps


def _calls_per_step_count(batches: dict[int, list], device: torch.device) -> list[tuple[int, int]]:
    """(step count, pipeline calls) for every step count any rank uses, ascending; the calls the busiest rank's."""
    counts = torch.zeros(MAX_STEPS + 1, dtype=torch.int64)
    for steps, calls in batches.items():
        counts[steps] = len(calls)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.to(device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [(steps, count) for steps, count in enumerate(counts.tolist()) if count]


@torch.no_grad()
def generate(
    pipeline: StableDiffusionXLPipeline,
    requests: list[ImageRequest],
    settings: GenerationSettings,
    negative: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """Generate this rank's `requests` -> {key: uint8 (3, H, W) on the CPU}. Every rank must call this (with
    its own share, possibly empty): it pads the UNet calls to the busiest rank's. A request's step count and
    guidance scale default to `settings`', its negative to `negative`: the (prompt_embeds, pooled) pair
    guidance pushes away from, the cached empty caption."""
    requests = [
        replace(
            request,
            num_inference_steps=request.num_inference_steps or settings.num_inference_steps,
            guidance_scale=settings.guidance_scale if request.guidance_scale is None else request.guidance_scale,
        )
        for request in requests
    ]
    if any(not 1 <= request.num_inference_steps <= MAX_STEPS for request in requests):
        raise ValueError(f"inference steps must be from 1 to {MAX_STEPS}")
    batches = _batches_by_steps(requests, settings.batch_size)
    dummy = ImageRequest(-1, torch.zeros_like(negative[0]), torch.zeros_like(negative[1]), DUMMY_SIZE, DUMMY_SIZE, 0, guidance_scale=settings.guidance_scale)
    images: dict[int, torch.Tensor] = {}
    for steps, calls in _calls_per_step_count(batches, device):
        for call in range(calls):
            mine = batches.get(steps, [])
            batch = mine[call] if call < len(mine) else [replace(dummy, num_inference_steps=steps)]
            images.update(_generate_batch(pipeline, batch, negative, device))
    from sdxl_trainer.distributed.fsdp import reshard_units  # FSDP2's modules load where a sharded UNet exists

    reshard_units(pipeline.unet)  # a sharded UNet: no backward followed these forwards to reshard what stays gathered
    images.pop(-1, None)
    return images


def _generate_batch(pipeline: StableDiffusionXLPipeline, batch: list[ImageRequest], negative: tuple[torch.Tensor, torch.Tensor],
                    device: torch.device) -> dict[int, torch.Tensor]:
    """One pipeline call: requests of one size, step count and guidance scale -> {key: uint8 (3, H, W)}."""
    negatives = [negative if request.negative is None else request.negative for request in batch]

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(tensors).to(device, torch.float32)

    latents = pipeline(
        prompt_embeds=stacked([request.prompt_embeds for request in batch]),
        pooled_prompt_embeds=stacked([request.pooled_prompt_embeds for request in batch]),
        negative_prompt_embeds=stacked([embeds for embeds, _ in negatives]),
        negative_pooled_prompt_embeds=stacked([pooled for _, pooled in negatives]),
        width=batch[0].width,
        height=batch[0].height,
        num_inference_steps=batch[0].num_inference_steps,
        guidance_scale=batch[0].guidance_scale,
        generator=[torch.Generator().manual_seed(request.seed) for request in batch],
        output_type="latent",
    ).images
    return {request.key: image.contiguous() for request, image in zip(batch, decode_latents(pipeline.vae, latents).cpu())}


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Scaled latents (N, 4, h, w) -> uint8 images (N, 3, 8h, 8w), decoded in the VAE's own dtype (the UNet's
    output may be bf16/fp16 under FSDP mixed precision). As diffusers' SDXL pipeline does: an fp16 VAE whose
    config sets force_upcast (SDXL's own, which overflows in fp16 into black or NaN images) decodes in fp32."""
    needs_upcasting = vae.dtype == torch.float16 and vae.config.get("force_upcast", False)
    # nn.Module's own cast: diffusers' override of .to() logs a warning on every dtype change of this model.
    if needs_upcasting:
        torch.nn.Module.to(vae, torch.float32)
    try:
        pixels = vae.decode(latents.to(vae.device, vae.dtype) / vae.config.scaling_factor).sample
    finally:
        if needs_upcasting:
            torch.nn.Module.to(vae, torch.float16)
    return ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


# ---- gathering -----------------------------------------------------------------------------------------


def gather_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Concatenate every rank's rows (n_rank, ...) in rank order on rank 0 (None elsewhere). Ranks may hold
    different numbers of rows; the trailing shape and dtype must agree. Every rank must call this."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64, device=device))
    counts = [int(count.item()) for count in counts]
    padded = torch.zeros(max(counts), *rows.shape[1:], dtype=rows.dtype, device=device)
    padded[: len(rows)] = rows.to(device)
    gathered = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    if dist.get_rank() != 0:
        return None
    return torch.cat([part[:count] for part, count in zip(gathered, counts)]).cpu()


def gather_images(images: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """{key: uint8 (3, H, W)} of every rank, merged on rank 0 ({} elsewhere). Sizes may differ: images
    travel padded to the largest size and are cut back. Every rank must call this."""
    keys = sorted(images)
    sizes = torch.tensor([[key, *images[key].shape[1:]] for key in keys], dtype=torch.int64).reshape(-1, 3)
    largest = torch.tensor([int(sizes[:, 1].max()) if keys else 0, int(sizes[:, 2].max()) if keys else 0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    height, width = int(largest[0]), int(largest[1])
    pixels = torch.zeros(len(keys), 3, height, width, dtype=torch.uint8)
    for row, key in enumerate(keys):
        pixels[row, :, : images[key].shape[1], : images[key].shape[2]] = images[key]
    all_sizes, all_pixels = gather_rows(sizes, device), gather_rows(pixels, device)
    if all_sizes is None:
        return {}
    return {int(key): all_pixels[row, :, :h, :w].clone() for row, (key, h, w) in enumerate(all_sizes.tolist())}
