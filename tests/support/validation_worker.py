"""Run under torchrun (1 or 2 CPU processes) by test_validation.py, with the FSDP-sharded tiny UNet:
validation loss twice, validation images before / after changing the weights / after restoring them, and
the image metrics (random networks of the real architectures) when the last argument is "score". Rank 0 writes report.json and images.safetensors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
from metric_networks import register_tiny_clip
from safetensors.torch import save_file

from sdxl_trainer.cache.reader import read_empty_prompt
from sdxl_trainer.distributed.fsdp import shard_unet
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from sdxl_trainer.evaluation.metrics import METRICS, MetricWeights, load_image_metrics
from sdxl_trainer.evaluation.sampling import GenerationSettings, gather_images, generate
from sdxl_trainer.evaluation.validation import ImageValidator, validation_loss
from sdxl_trainer.training.dataset import CachedDataset
from sdxl_trainer.training.holdout import SplitSettings, choose_holdout, dataset_item_keys
from sdxl_trainer.training.loss import build_noise_scheduler


def build_sampling_pipeline(pipeline_dir: str, unet: torch.nn.Module, device: torch.device, vae: AutoencoderKL | None = None) -> StableDiffusionXLPipeline:
    """The base pipeline around the given FSDP-sharded UNet, without text encoders (prompts come as cached
    embeddings); the VAE in fp32 unless given. The trainer hands an unsharded copy over instead (handoff.py);
    generating with the sharded UNet directly shows the padding of FSDP calls in sampling.generate."""
    vae = vae or AutoencoderKL.from_pretrained(pipeline_dir, subfolder="vae", torch_dtype=torch.float32)
    pipeline = StableDiffusionXLPipeline.from_pretrained(
        pipeline_dir, unet=unet, vae=vae.to(device).eval(), text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


SHARE = 0.2  # of the sample cache's items: 6 items, so 2 ranks get 3 each, in several buckets
SETTINGS = GenerationSettings(num_inference_steps=2, guidance_scale=5.0, batch_size=2)


def main(pipeline_dir: str, cache_dir: str, weights_dir: str, data_dir: str, output_dir: str, score: str) -> None:
    world = init_distributed()
    dataset = CachedDataset([Path(cache_dir)])
    holdout = choose_holdout(dataset_item_keys(dataset), dataset.bucket_ids(), SplitSettings(SHARE, SHARE), seed=0)
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=None)
    scheduler = build_noise_scheduler(pipeline_dir, "epsilon", zero_terminal_snr=False)
    report: dict = {"loss": [validation_loss(unet, dataset, holdout.loss_items, scheduler, holdout.seed, world.device, batch_size=2) for _ in range(2)]}

    weights = Path(weights_dir)
    metrics = load_image_metrics(
        MetricWeights(weights / "inception.pth", weights / "alexnet.pth", weights / "hps.pt"),
        wanted=METRICS if score == "score" else (),
        allow_download=False,
        hps_architecture=register_tiny_clip(weights),
    )
    validator = ImageValidator(dataset, holdout.image_items, metrics, holdout.seed, world.device, SETTINGS, data_dirs=[Path(data_dir)])
    pipeline = build_sampling_pipeline(pipeline_dir, unet, world.device)
    negative = read_empty_prompt(Path(cache_dir))
    report["scores"] = validator(pipeline, negative)
    report["decoded_references"] = validator.decoded_reference_count

    before = gather_images(validator.generate(pipeline, negative), world.device)
    saved = [local_shard(parameter).clone() for parameter in unet.parameters()]
    with torch.no_grad():
        for parameter in unet.parameters():  # every rank changes its own shard
            local_shard(parameter).mul_(1.05)
    changed = gather_images(validator.generate(pipeline, negative), world.device)
    report["loss_changed_weights"] = validation_loss(unet, dataset, holdout.loss_items, scheduler, holdout.seed, world.device, batch_size=2)
    with torch.no_grad():
        for parameter, local in zip(unet.parameters(), saved):
            local_shard(parameter).copy_(local)
    restored = gather_images(validator.generate(pipeline, negative), world.device)

    if score == "score":  # mixed precision as on GPUs: bf16 compute over fp32 shards (the VAE decodes in fp32)
        bf16_unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
        shard_unet(bf16_unet, world.mesh, param_dtype=torch.bfloat16)
        bf16_pipeline = build_sampling_pipeline(pipeline_dir, bf16_unet, world.device, vae=pipeline.vae)
        bf16_images = gather_images(generate(bf16_pipeline, validator.requests()[:1], SETTINGS, negative, world.device), world.device)
        report["bf16_image_shapes"] = {str(key): list(image.shape) for key, image in bf16_images.items()}

    if world.is_main:
        output = Path(output_dir)
        report["items"] = sorted(before)
        report["restored_equal"] = all(torch.equal(before[key], restored[key]) for key in before)
        report["changed_max_difference"] = min(int((before[key].int() - changed[key].int()).abs().max()) for key in before)
        save_file({str(key): image for key, image in before.items()}, output / "images.safetensors")
        (output / "report.json").write_text(json.dumps(report))
    shutdown_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
