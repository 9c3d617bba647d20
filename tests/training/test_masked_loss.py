"""--masked_loss: the cache holds each item's loss mask at latent size (from its name.mask.png, or its alpha
channel) through the same crop as its image; the trainer weights each latent pixel's loss by it, mirrors it with
a flipped sample and trains items without one everywhere; a masked-out pixel gets no gradient. Also the run that
issue 29 names: flips, masks, pseudo-Huber loss, logit-normal timesteps and two weighted caches on 2 processes,
resumed bitwise."""

from __future__ import annotations

import dataclasses
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import MAX_RESOLUTION, MIN_RESOLUTION, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir, scalars
from diffusers import DDPMScheduler
from PIL import Image
from trainer_runs import RESUME_AT, exported_unet, resumed_copy, train

from sdxl_trainer.cache.buckets import LATENT_DOWNSCALE, plan_crop
from sdxl_trainer.cache.format import LOSS_MASK_KEY, sha256_bytes
from sdxl_trainer.cache.reader import CacheReader, load_manifest
from sdxl_trainer.preparation.images import resize_and_crop, to_latent_mask
from sdxl_trainer.preparation.items import SkippedItem, mask_image, read_mask_file
from sdxl_trainer.preparation.scan import SourcePair
from sdxl_trainer.training.dataset import CachedDataset, choose_views, collate, flip_draws
from sdxl_trainer.training.loss import sample_losses, training_loss
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import draw_sample_randomness

CACHE_FLAGS = (*SAMPLE_RESOLUTION_FLAGS, "--flip_aug")


def copy_pair(name: str, folder, new_stem: str | None = None) -> None:
    stem = new_stem or name.rsplit(".", 1)[0]
    shutil.copy(SAMPLE_DATASET / name, folder / f"{stem}.{name.rsplit('.', 1)[1]}")
    shutil.copy(SAMPLE_DATASET / f"{name.rsplit('.', 1)[0]}.txt", folder / f"{stem}.txt")


def left_half_black(size: tuple[int, int]) -> Image.Image:
    mask = np.full((size[1], size[0]), 255, np.uint8)
    mask[:, : size[0] // 2] = 0
    return Image.fromarray(mask, "L")


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory):
    """sample_00 with a mask file (left half black), alpha_17 an RGBA image (top half transparent), three images
    without a mask, sample_02 with a mask of another shape, and a mask without an image."""
    folder = tmp_path_factory.mktemp("masked") / "data"
    folder.mkdir()
    for name in ("sample_00.jpg", "sample_01.jpg", "sample_02.jpg", "sample_03.jpg", "sample_04.jpg"):
        copy_pair(name, folder)
    left_half_black(Image.open(folder / "sample_00.jpg").size).save(folder / "sample_00.mask.png")
    Image.new("L", (10, 50), 255).save(folder / "sample_02.mask.png")
    Image.new("L", (64, 64), 255).save(folder / "orphan.mask.png")
    rgba = Image.open(SAMPLE_DATASET / "sample_17.jpg").convert("RGBA")
    alpha = np.full((rgba.height, rgba.width), 255, np.uint8)
    alpha[: rgba.height // 2] = 0
    rgba.putalpha(Image.fromarray(alpha, "L"))
    rgba.save(folder / "alpha_17.png")
    shutil.copy(SAMPLE_DATASET / "sample_17.txt", folder / "alpha_17.txt")
    return folder


@pytest.fixture(scope="module")
def masked_cache(tmp_path_factory, masked_data, tiny_pipeline_dir):
    cache_dir = tmp_path_factory.mktemp("masked_cache") / "cache"
    flags = ["--data_dir", str(masked_data), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
             *CACHE_FLAGS, "--mask_files", "--alpha_mask"]
    assert process_data_dir(flags) == 0
    return cache_dir


@pytest.fixture(scope="module")
def plain_cache(tmp_path_factory, tiny_pipeline_dir):
    """Five other sample images, no masks: the second cache of the combined run."""
    folder = tmp_path_factory.mktemp("plain") / "data"
    folder.mkdir()
    for name in ("sample_07.jpg", "sample_08.jpg", "sample_10.jpg", "sample_11.png", "sample_12.png", "sample_13.png"):
        copy_pair(name, folder)
    cache_dir = folder.parent / "cache"
    flags = ["--data_dir", str(folder), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir), *CACHE_FLAGS]
    assert process_data_dir(flags) == 0
    return cache_dir


def cached_masks(cache_dir) -> dict[str, torch.Tensor | None]:
    reader = CacheReader(cache_dir)
    return {
        row["image_path"]: reader.read(row["shard"], row["index_in_shard"], keys=(LOSS_MASK_KEY,))[LOSS_MASK_KEY].float() if row["has_loss_mask"] else None
        for row in load_manifest(cache_dir).to_pylist()
    }


def test_the_cache_holds_each_mask_through_its_images_crop_at_latent_size(masked_cache, masked_data):
    rows = {row["image_path"]: row for row in load_manifest(masked_cache).to_pylist()}
    masks = cached_masks(masked_cache)
    assert {path: mask is not None for path, mask in masks.items()} == {
        "sample_00.jpg": True, "alpha_17.png": True, "sample_01.jpg": False, "sample_03.jpg": False, "sample_04.jpg": False,
    }
    log = next((masked_cache / "logs").glob("errors-*.log")).read_text()
    assert "sample_02.jpg: its mask file sample_02.mask.png is 10x50 px, the image" in log and "draw the mask at the image's size" in log
    assert "orphan.mask.png: a mask file without an image of its name" in log

    # The mask file: the same resize and crop as the image, then each 8 x 8 block's mean.
    row = rows["sample_00.jpg"]
    plan = plan_crop(row["original_width"], row["original_height"], MIN_RESOLUTION, MAX_RESOLUTION)
    expected = to_latent_mask(resize_and_crop(Image.open(masked_data / "sample_00.mask.png"), plan))
    mask = masks["sample_00.jpg"]
    assert mask.shape == (1, row["bucket_height"] // LATENT_DOWNSCALE, row["bucket_width"] // LATENT_DOWNSCALE)
    assert torch.allclose(mask, expected, atol=1e-3)  # stored in fp16
    # By hand: the black half ends at half the resized width, crop_left into the crop.
    edge = (plan.resized_width / 2 - plan.crop_left) / LATENT_DOWNSCALE
    assert mask[0, :, : int(edge) - 1].max() < 0.01 and mask[0, :, int(edge) + 2 :].min() > 0.99

    # The alpha channel: transparent top half.
    row = rows["alpha_17.png"]
    plan = plan_crop(row["original_width"], row["original_height"], MIN_RESOLUTION, MAX_RESOLUTION)
    edge = (plan.resized_height / 2 - plan.crop_top) / LATENT_DOWNSCALE
    alpha_mask = masks["alpha_17.png"]
    assert alpha_mask[0, : int(edge) - 1].max() < 0.01 and alpha_mask[0, int(edge) + 2 :].min() > 0.99
    assert process_data_dir(["--verify", "--cache_dir", str(masked_cache)]) == 0


def test_a_mask_file_of_its_images_shape_but_another_size_is_stretched_to_it(tmp_path):
    image_path = tmp_path / "a.jpg"
    left_half_black((60, 40)).save(tmp_path / "a.mask.png")
    source = SourcePair(image_path, "a.jpg", mask_path=tmp_path / "a.mask.png")
    mask_file = read_mask_file(source)
    assert mask_file[1] == sha256_bytes((tmp_path / "a.mask.png").read_bytes())
    mask = mask_image(source, mask_file, (120, 80), None)
    assert mask.size == (120, 80)
    assert np.asarray(mask)[:, :58].max() == 0 and np.asarray(mask)[:, 62:].min() == 255
    (tmp_path / "broken.mask.png").write_bytes(b"not a png")
    with pytest.raises(SkippedItem, match="its mask file broken.mask.png is unreadable"):
        broken = SourcePair(image_path, "a.jpg", mask_path=tmp_path / "broken.mask.png")
        mask_image(broken, read_mask_file(broken), (120, 80), None)


def test_an_edited_mask_file_is_cached_again_on_the_next_run_and_nothing_else(tmp_path, masked_data, masked_cache, tiny_pipeline_dir, capsys):
    data, cache_dir = tmp_path / "data", tmp_path / "cache"
    shutil.copytree(masked_data, data)
    shutil.copytree(masked_cache, cache_dir)
    flags = ["--data_dir", str(data), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
             *CACHE_FLAGS, "--mask_files", "--alpha_mask"]
    capsys.readouterr()
    assert process_data_dir(flags) == 0
    assert "already cached: 5." in capsys.readouterr().out  # nothing changed, nothing encoded
    Image.new("L", Image.open(data / "sample_00.jpg").size, 255).save(data / "sample_00.mask.png")  # now: learn everything
    assert process_data_dir(flags) == 0
    assert "already cached: 4, cached: 1, upscaled: 0, with a loss mask: 1." in capsys.readouterr().out
    mask = cached_masks(cache_dir)["sample_00.jpg"]
    assert torch.equal(mask, torch.ones_like(mask))


def test_the_dataset_gives_each_item_its_mask_or_ones_and_a_flipped_sample_its_mirrored_mask(masked_cache, masked_data):
    dataset = CachedDataset([masked_cache], flip_aug=True, loss_masks=True)
    masks = cached_masks(masked_cache)
    for index in range(len(dataset)):
        mask = masks[dataset.image_paths[index]]
        got = dataset[index][LOSS_MASK_KEY].float()
        assert torch.equal(got, mask) if mask is not None else torch.equal(got, torch.ones_like(got)), dataset.image_paths[index]
    assert LOSS_MASK_KEY not in CachedDataset([masked_cache])[0]

    item = dataset.image_paths.index("sample_00.jpg")
    samples = [item + copy * len(dataset) for copy in range(8)]  # copies of one item: each draws its own coin
    batch = collate([dataset[sample] for sample in samples])
    flips = flip_draws(5, 0, samples)
    assert 0 < flips.sum() < len(samples)
    chosen = choose_views(batch, 5, 0)
    for row, flipped in enumerate(flips):
        assert torch.equal(chosen[LOSS_MASK_KEY][row], batch[LOSS_MASK_KEY][row].flip(-1) if flipped else batch[LOSS_MASK_KEY][row])
    # The mirrored mask is the mask of the mirrored crop: the mirrored mask image cut at the mirrored offset.
    plan = plan_crop(int(dataset.time_ids[item][1]), int(dataset.time_ids[item][0]), MIN_RESOLUTION, MAX_RESOLUTION)
    mirrored_plan = dataclasses.replace(plan, crop_left=int(dataset.crop_left_flipped[item]))
    mirrored_image = Image.open(masked_data / "sample_00.mask.png").transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert torch.allclose(to_latent_mask(resize_and_crop(mirrored_image, mirrored_plan)), masks["sample_00.jpg"].flip(-1), atol=2e-3)


class OutputIs(torch.nn.Module):
    """A "UNet" whose prediction is a parameter: the loss's gradient with respect to it is the gradient per latent pixel."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.prediction = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))

    def forward(self, *args, **kwargs):
        return SimpleNamespace(sample=self.prediction)


def masked_batch() -> dict[str, torch.Tensor]:
    mask = torch.ones(2, 1, 8, 8)
    mask[0, :, :, :4] = 0  # sample 0: the left half masked out; sample 1: trained everywhere
    return {
        "latents": torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)),
        "prompt_embeds": torch.zeros(2, 77, 32),
        "pooled_prompt_embeds": torch.zeros(2, 32),
        "time_ids": torch.zeros(2, 6),
        "sample_index": torch.tensor([3, 4]),
        LOSS_MASK_KEY: mask,
    }


@pytest.mark.parametrize("normalize_area", [False, True])
def test_a_masked_out_half_gets_no_gradient_and_the_loss_is_the_masked_mean(normalize_area):
    batch, scheduler = masked_batch(), DDPMScheduler()
    unet = OutputIs((2, 4, 8, 8))
    settings = NoiseSettings(conditional_dropout_percent=0.0, masked_loss_normalize_area=normalize_area)
    loss = training_loss(unet, batch, scheduler, (torch.zeros(77, 32), torch.zeros(32)), 5, 0, settings)
    loss.backward()
    gradient = unet.prediction.grad
    assert torch.count_nonzero(gradient[0, :, :, :4]) == 0
    assert torch.count_nonzero(gradient[0, :, :, 4:]) == gradient[0, :, :, 4:].numel()
    assert torch.count_nonzero(gradient[1]) == gradient[1].numel()

    noise = draw_sample_randomness(batch["latents"], batch["sample_index"], 5, 0, settings).noise
    squared = (unet.prediction.detach() - noise) ** 2
    # Sample 0: the unmasked half's sum over the whole latent's size, or over the half's size when normalised.
    by_hand = torch.stack([squared[0, :, :, 4:].sum() * (2 if normalize_area else 1), squared[1].sum()]) / squared[0].numel()
    assert loss.item() == pytest.approx(by_hand.mean().item(), rel=1e-6)
    # A sample trained everywhere loses exactly what it would without a mask, normalised or not.
    unmasked = sample_losses(unet.prediction.detach(), noise, torch.zeros(2, dtype=torch.long), scheduler, settings)
    masked = sample_losses(unet.prediction.detach(), noise, torch.zeros(2, dtype=torch.long), scheduler, settings, batch[LOSS_MASK_KEY])
    assert masked[1].item() == pytest.approx(unmasked[1].item(), rel=1e-6)


def test_masks_compose_with_huber_loss_per_element_before_the_mean():
    batch, scheduler = masked_batch(), DDPMScheduler()
    prediction, target = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([100, 900])
    settings = NoiseSettings(conditional_dropout_percent=0.0, loss_type="huber", huber_schedule="constant", huber_c=0.3)
    difference = prediction - target
    huber = 0.3 * 2 * ((difference ** 2 + 0.09).sqrt() - 0.3)
    by_hand = (huber * batch[LOSS_MASK_KEY]).mean(dim=(1, 2, 3))
    assert torch.allclose(sample_losses(prediction, target, timesteps, scheduler, settings, batch[LOSS_MASK_KEY]), by_hand, rtol=1e-6)


def test_masked_loss_is_refused_without_masks_in_any_cache(sample_cache_dir):
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig, with_cache_settings

    config = parse_config(TrainConfig, ["--cached_dataset_dirs", str(sample_cache_dir), "--masked_loss"])
    assert with_cache_settings(config)[1].problems == [
        "--masked_loss trains with the caches' loss masks, and none of the caches holds any: re-cache with sdxl_process_data_dir.py "
        "--mask_files (name.mask.png beside each image) or --alpha_mask (into a new --cache_dir), or drop --masked_loss"
    ]


@pytest.mark.multiprocess
def test_flips_masks_huber_logit_normal_and_two_weighted_caches_resume_bitwise_on_2_processes(tmp_path, masked_cache, plain_cache, tiny_pipeline_dir):
    caches = [masked_cache, plain_cache]
    options = ("--flip_aug", "--masked_loss", "--masked_loss_normalize_area", "--loss_type", "huber", "--timestep_sampling", "logit_normal",
               "--dataset_loss_weights", "1", "0.5", "--gradient_accumulation_steps", "2")
    straight = train(tmp_path / "straight", caches, tiny_pipeline_dir, "constant", *options)
    resumed_copy(straight, tmp_path / "resumed")
    resumed = train(tmp_path / "resumed", caches, tiny_pipeline_dir, "constant", *options, "--load_saved_state", "latest")
    losses = scalars(straight, "train/loss")
    assert len(losses) > RESUME_AT + 1
    assert scalars(resumed, "train/loss") == losses[RESUME_AT:]
    expected, got = exported_unet(straight), exported_unet(resumed)
    assert all(torch.equal(expected[key], got[key]) for key in expected)
