"""--flip_aug: the cache holds each crop's mirror (its exact VAE encoding) and the mirrored crop's offset; the
trainer trains the mirror with probability 1/2 per sample and epoch, drawn from the seed apart from every other
draw, with the mirrored micro-conditioning; caches without mirrors are refused. A 2-process run with flips (and
masks, pseudo-Huber loss, logit-normal timesteps and two weighted caches) resumes bitwise: test_masked_loss.py."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import MAX_RESOLUTION, MIN_RESOLUTION, REPO_ROOT, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir, run_processes, trainer_flags

from sdxl_trainer.cache.buckets import plan_crop
from sdxl_trainer.cache.format import FLIPPED_KEY, MANIFEST_DIR
from sdxl_trainer.cache.reader import CacheReader, load_manifest
from sdxl_trainer.models.encoders import load_encoders
from sdxl_trainer.preparation.items import prepare_item
from sdxl_trainer.preparation.scan import SourcePair
from sdxl_trainer.training.dataset import CachedDataset, choose_views, collate, flip_draws


@pytest.fixture(scope="module")
def flip_cache(tmp_path_factory, tiny_pipeline_dir):
    cache_dir = tmp_path_factory.mktemp("flip") / "cache"
    flags = ["--data_dir", str(SAMPLE_DATASET), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
             *SAMPLE_RESOLUTION_FLAGS, "--flip_aug"]
    assert process_data_dir(flags) == 0
    return cache_dir


@pytest.mark.slow
def test_the_cache_holds_each_crops_mirror_and_the_mirrored_crop_offset(flip_cache, tiny_pipeline_dir):
    manifest = load_manifest(flip_cache).to_pylist()
    reader = CacheReader(flip_cache)
    encoders = load_encoders(str(tiny_pipeline_dir), None, torch.device("cpu"), torch.float32)
    for row in manifest[:3]:
        tensors = reader.read(row["shard"], row["index_in_shard"], keys=("latents", FLIPPED_KEY))
        path = SAMPLE_DATASET / row["image_path"]
        prepared = prepare_item(SourcePair(path, row["image_path"]), path.read_bytes(), row["image_sha256"], "x", MIN_RESOLUTION, MAX_RESOLUTION)
        mirrored = encoders.encode_images(torch.flip(prepared.pixels, dims=[-1])[None])[0]
        assert torch.allclose(tensors[FLIPPED_KEY].float(), mirrored, atol=2e-3 * mirrored.abs().max().item())  # stored in fp16
        assert not torch.allclose(tensors[FLIPPED_KEY], tensors["latents"])
    for row in manifest:
        plan = plan_crop(row["original_width"], row["original_height"], MIN_RESOLUTION, MAX_RESOLUTION)
        assert row["crop_left_flipped"] == plan.resized_width - plan.bucket.width - row["crop_left"]
    assert any(row["crop_left_flipped"] == row["crop_left"] + 1 for row in manifest)  # an odd excess width
    assert process_data_dir(["--verify", "--cache_dir", str(flip_cache)]) == 0


def test_manifest_parts_from_before_mirrors_read_with_no_mirrored_offset(flip_cache, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(flip_cache, old)
    for part in (old / MANIFEST_DIR).glob("*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.drop_columns(["crop_left_flipped"]).replace_schema_metadata(table.schema.metadata), part)
    manifest = load_manifest(old)
    assert manifest.column("crop_left_flipped").null_count == len(manifest) > 0


def test_half_the_draws_flip_each_fixed_by_seed_epoch_and_sample():
    draws = flip_draws(5, 0, list(range(20_000)))
    assert draws.mean() == pytest.approx(0.5, abs=0.01)
    assert np.array_equal(draws, flip_draws(5, 0, list(range(20_000))))
    assert not np.array_equal(draws, flip_draws(5, 1, list(range(20_000))))  # a new coin every epoch
    assert not np.array_equal(draws, flip_draws(6, 0, list(range(20_000))))


def test_a_flipped_sample_trains_the_mirrored_latents_and_crop_offset(flip_cache):
    dataset = CachedDataset([flip_cache], flip_aug=True)
    bucket_ids = dataset.bucket_ids()
    items = np.flatnonzero(bucket_ids == bucket_ids[0])[:4]
    batch = collate([dataset[int(item)] for item in items])
    for epoch in range(3):
        chosen = choose_views(batch, 5, epoch)
        assert set(chosen) == set(batch) - {FLIPPED_KEY, "time_ids_flipped"}
        for row, flipped in enumerate(flip_draws(5, epoch, batch["sample_index"].tolist())):
            source = FLIPPED_KEY if flipped else "latents"
            assert torch.equal(chosen["latents"][row], batch[source][row])
            assert chosen["time_ids"][row].tolist() == batch["time_ids_flipped" if flipped else "time_ids"][row].tolist()
            crop_left = dataset.crop_left_flipped[items[row]] if flipped else dataset.time_ids[items[row]][3]
            assert chosen["time_ids"][row][3].item() == crop_left
    unflipped = collate([CachedDataset([flip_cache])[int(item)] for item in items])
    assert choose_views(unflipped, 5, 0) is unflipped  # without --flip_aug nothing is drawn or changed


@pytest.mark.multiprocess
def test_caches_without_mirrors_are_refused_naming_them(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "refused", "--flip_aug"),
                           expect_success=False)
    assert result.returncode != 0
    assert f"--flip_aug trains the mirrored latents, which {sample_cache_dir} lack: re-cache with sdxl_process_data_dir.py --flip_aug" in result.stdout + result.stderr
