"""Validation loss and validation images on the tiny pipeline and the sample cache: the loss batches, real
images cropped exactly as cached, and (on 1 and 2 gloo processes with the FSDP-sharded UNet) a repeatable
loss, images that come from the given weights, and the metrics end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import MAX_RESOLUTION, MIN_RESOLUTION, REPO_ROOT, SAMPLE_DATASET, run_processes
from metric_networks import write_metric_weights
from safetensors.torch import load_file

from sdxl_trainer.evaluation.validation import TIMESTEP_RANGES, loss_batches, reference_images, source_image
from sdxl_trainer.preparation.items import prepare_item
from sdxl_trainer.preparation.scan import SourcePair
from sdxl_trainer.training.dataset import CachedDataset


def test_loss_batches_cover_every_item_once_with_ranges_in_turn():
    bucket_ids = np.array([0, 1, 0, 1, 2, 0, 0, 1, 2, 2, 0])
    items = np.array([10, 0, 3, 5, 7, 1, 9, 2])
    batches = loss_batches(items, bucket_ids, batch_size=2)
    flat = [int(item) for _, batch in batches for item in batch]
    assert sorted(flat) == sorted(items.tolist())
    for range_index, batch in batches:
        assert len(set(bucket_ids[batch].tolist())) == 1 and len(batch) <= 2
        for item in batch:  # sorted position k takes range k mod 3
            assert int(np.searchsorted(np.sort(items), item)) % len(TIMESTEP_RANGES) == range_index
    reordered = loss_batches(items[::-1], bucket_ids, batch_size=2)  # the order items come in does not matter
    assert len(reordered) == len(batches)
    assert all(r1 == r2 and np.array_equal(b1, b2) for (r1, b1), (r2, b2) in zip(batches, reordered))


def test_source_images_are_cropped_exactly_as_cached(sample_cache_dir, tmp_path):
    dataset = CachedDataset([sample_cache_dir])
    for item in range(len(dataset)):
        image = source_image(dataset, item, [SAMPLE_DATASET])
        assert image is not None, dataset.image_paths[item]
        path = SAMPLE_DATASET / dataset.image_paths[item]
        data = path.read_bytes()
        prepared = prepare_item(SourcePair(path, dataset.image_paths[item]), data, dataset.image_sha256[item], "x", MIN_RESOLUTION, MAX_RESOLUTION)
        cached_pixels = ((prepared.pixels + 1) * 127.5).round().byte()
        assert image.shape == cached_pixels.shape and bool((image == cached_pixels).all()), dataset.image_paths[item]
    # A changed or missing source is not used (the caller falls back to the decoded latents).
    changed = tmp_path / "data"
    changed.mkdir()
    (changed / dataset.image_paths[0]).parent.mkdir(parents=True, exist_ok=True)
    (changed / dataset.image_paths[0]).write_bytes((SAMPLE_DATASET / dataset.image_paths[0]).read_bytes() + b"\0")
    assert source_image(dataset, 0, [changed]) is None
    assert source_image(dataset, 1, [changed]) is None


def test_reference_images_fall_back_to_decoded_latents(sample_cache_dir, tiny_pipeline_dir, tmp_path):
    from diffusers import AutoencoderKL

    dataset = CachedDataset([sample_cache_dir])
    vae = AutoencoderKL.from_pretrained(tiny_pipeline_dir, subfolder="vae")
    images, decoded = reference_images(dataset, [0, 1, 2], None, vae)
    assert decoded == 3
    for item, image in zip([0, 1, 2], images):
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, *dataset.bucket_sizes[item][::-1])
    # Per item: sources found are used, the others decoded.
    (tmp_path / dataset.image_paths[1]).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / dataset.image_paths[1]).write_bytes((SAMPLE_DATASET / dataset.image_paths[1]).read_bytes())
    mixed, decoded = reference_images(dataset, [0, 1, 2], [tmp_path], vae)
    assert decoded == 2 and torch.equal(mixed[1], source_image(dataset, 1, [SAMPLE_DATASET])) and torch.equal(mixed[0], images[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pipeline_dir, sample_cache_dir) -> dict[int, tuple[dict, dict]]:
    weights_dir = tmp_path_factory.mktemp("validation_weights")
    write_metric_weights(weights_dir)
    results = {}
    for processes in (1, 2):
        output = tmp_path_factory.mktemp(f"validation_{processes}")
        run_processes(
            processes,
            REPO_ROOT / "tests" / "support" / "validation_worker.py",
            # The image metrics are scored on 2 processes only: the slow part (FID of 2048-wide features) once.
            [str(tiny_pipeline_dir), str(sample_cache_dir), str(weights_dir), str(SAMPLE_DATASET), str(output), "score" if processes == 2 else "no"],
        )
        results[processes] = (json.loads((output / "report.json").read_text()), load_file(output / "images.safetensors"))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_same_model_gives_the_same_validation_loss(runs, processes):
    report, _ = runs[processes]
    first, second = report["loss"]
    assert first == second
    assert set(first) == {"val/loss", "val/loss_t0-333", "val/loss_t333-667", "val/loss_t667-1000"}
    assert report["loss_changed_weights"]["val/loss"] != first["val/loss"]


@pytest.mark.multiprocess
def test_validation_loss_is_the_same_on_one_and_two_processes(runs):
    one, two = runs[1][0]["loss"][0], runs[2][0]["loss"][0]
    for tag in one:
        assert two[tag] == pytest.approx(one[tag], rel=1e-5), tag


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_validation_images_come_from_the_given_weights(runs, processes):
    report, images = runs[processes]
    assert len(report["items"]) == 6 and len(images) == 6
    assert report["restored_equal"], "the same weights must give identical images"
    assert report["changed_max_difference"] > 0, "changed weights must change every image"


@pytest.mark.multiprocess
def test_validation_images_do_not_depend_on_the_number_of_processes(runs):
    one, two = runs[1][1], runs[2][1]
    assert one.keys() == two.keys()
    for key in one:
        assert one[key].shape == two[key].shape
        # Same seeds and weights; only batch composition differs, which moves a pixel by a rounding step at most.
        assert (one[key].int() - two[key].int()).abs().max() <= 2, key


@pytest.mark.multiprocess
def test_image_metrics_end_to_end_on_two_processes(runs):
    report, _ = runs[2]
    scores = report["scores"]
    assert set(scores) == {"val/fid", "val/kid", "val/is", "val/lpips", "val/hpsv2"}
    assert all(math.isfinite(value) for value in scores.values())
    assert report["decoded_references"] == 0  # every held-out source image was found and matched the cache
    assert scores["val/fid"] > 0 and scores["val/is"] >= 1.0 and 0 < scores["val/lpips"] and -1 <= scores["val/hpsv2"] <= 1
    assert runs[1][0]["scores"] == {}  # no metric wanted: nothing loaded, nothing scored


@pytest.mark.multiprocess
def test_generation_with_bf16_compute_over_fp32_shards(runs):
    report, images = runs[2]
    assert len(report["bf16_image_shapes"]) == 2  # one image per rank
    for key, shape in report["bf16_image_shapes"].items():
        assert shape == list(images[key].shape)


def test_an_fp16_vae_that_asks_for_upcasting_decodes_in_fp32(tiny_pipeline_dir):
    """SDXL's own VAE overflows in fp16 (its config sets force_upcast); decoding it in fp16, as validation and
    sample images did under --mixed_precision fp16, gives NaN/black images. Here the tiny VAE's first decoder
    layer is scaled up until fp16 overflows, standing in for SDXL's."""
    from diffusers import AutoencoderKL

    from sdxl_trainer.evaluation.sampling import decode_latents

    vae = AutoencoderKL.from_pretrained(tiny_pipeline_dir, subfolder="vae")
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(3e4)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    in_fp32 = decode_latents(vae, latents)
    torch.nn.Module.to(vae, torch.float16)
    assert vae.config.force_upcast
    decoded = decode_latents(vae, latents)
    assert vae.dtype == torch.float16  # cast back afterwards
    assert (decoded.int() - in_fp32.int()).abs().max() <= 1
    with torch.no_grad():
        assert not torch.isfinite(vae.decode(latents.half() / vae.config.scaling_factor).sample).all()  # what fp16 gives
