"""sdxl_process_data_dir.py end to end on the tiny SDXL: resume after SIGKILL, changed items, changed settings,
verify + repair, full disk, upscaling, dry run, moving the cache, and the multi-worker launcher."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from caching_runs import RESOLUTION_FLAGS, make_dataset, run_cache
from conftest import REPO_ROOT, process_data_dir, run_processes
from PIL import Image
from upscaler_weights import save_weights, tiny_rrdbnet

from sdxl_trainer.cache import writer as cache_writer
from sdxl_trainer.cache.buckets import Bucket, nearest_aspect_bucket
from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import CACHE_INFO_FILE, EMPTY_PROMPT_FILE, MANIFEST_DIR, SHARD_DIR
from sdxl_trainer.cache.reader import CacheReader, load_manifest
from sdxl_trainer.preparation.scan import worker_of
from sdxl_trainer.runtime.hashing import sha256_file


def manifest_paths(cache_dir: Path) -> Counter:
    return Counter(load_manifest(cache_dir).column("image_path").to_pylist())



def shard_digests(cache_dir: Path) -> dict[str, str]:
    return {path.name: sha256_file(path) for path in (cache_dir / SHARD_DIR).glob("*.safetensors")}



@pytest.mark.multiprocess
def test_killed_worker_resumes_without_redoing_finished_shards(tmp_path, tiny_pipeline_dir):
    data_dir = make_dataset(tmp_path / "data", 24)
    cache_dir = tmp_path / "cache"
    args = [
        "--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
        *RESOLUTION_FLAGS, "--items_per_shard", "2", "--batch_size", "2",
    ]

    def kill_after_two_shards(workers: list[multiprocessing.process.BaseProcess]) -> None:
        deadline = time.monotonic() + 300
        while len(list((cache_dir / MANIFEST_DIR).glob("*.parquet"))) < 2 and time.monotonic() < deadline and workers[0].exitcode is None:
            time.sleep(0.01)
        if workers[0].exitcode is None:
            os.kill(workers[0].pid, signal.SIGKILL)

    killed = run_processes(1, REPO_ROOT / "sdxl_process_data_dir.py", args, expect_success=False, while_running=kill_after_two_shards)
    assert "was ended by SIGKILL" in killed.stderr  # killed mid-run, not finished

    committed = manifest_paths(cache_dir)
    assert 4 <= sum(committed.values()) < 24 and set(committed.values()) == {1}
    finished = {name: digest for name, digest in shard_digests(cache_dir).items() if (cache_dir / MANIFEST_DIR / f"{Path(name).stem}.parquet").exists()}
    mtimes = {name: (cache_dir / SHARD_DIR / name).stat().st_mtime_ns for name in finished}

    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "2", "--batch_size", "2") == 0
    assert manifest_paths(cache_dir) == Counter({f"img{index:03d}.png": 1 for index in range(24)})
    for name, digest in finished.items():  # finished shards were neither rewritten nor replaced
        assert sha256_file(cache_dir / SHARD_DIR / name) == digest
        assert (cache_dir / SHARD_DIR / name).stat().st_mtime_ns == mtimes[name]
    assert [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")] == []
    manifest = load_manifest(cache_dir)
    assert set(manifest.column("shard").to_pylist()) == {p.name for p in (cache_dir / SHARD_DIR).iterdir()}  # no orphan shard left



@pytest.fixture
def small_cache(tmp_path, tiny_pipeline_dir):
    data_dir = make_dataset(tmp_path / "data", 7)
    cache_dir = tmp_path / "cache"
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "3") == 0
    return data_dir, cache_dir



def test_rerun_skips_valid_items_and_redoes_changed_ones(small_cache, tiny_pipeline_dir, capsys):
    data_dir, cache_dir = small_cache
    capsys.readouterr()
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir) == 0
    assert "already cached: 7." in capsys.readouterr().out

    (data_dir / "img001.txt").write_text("a new caption")
    Image.new("RGB", (300, 280), (10, 200, 30)).save(data_dir / "img004.png")
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir) == 0
    out = capsys.readouterr().out
    assert "cached: 2" in out and "already cached: 5" in out
    rows = {row["image_path"]: row for row in load_manifest(cache_dir).to_pylist()}
    assert len(rows) == 7 and rows["img001.png"]["caption"] == "a new caption"
    assert (rows["img004.png"]["original_width"], rows["img004.png"]["original_height"]) == (300, 280)
    assert rows["img004.png"]["image_sha256"] == sha256_file(data_dir / "img004.png")



def test_changed_settings_are_refused_with_what_differs(small_cache, tiny_pipeline_dir, capsys):
    data_dir, cache_dir = small_cache
    before = shard_digests(cache_dir)
    capsys.readouterr()
    code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--min_resolution", "256", "--max_resolution", "384"]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "max_resolution: cache 320, now 384" in out and "choose a new --cache_dir" in out
    assert shard_digests(cache_dir) == before



def test_verify_finds_damage_and_a_rerun_repairs_it(small_cache, tiny_pipeline_dir, capsys):
    data_dir, cache_dir = small_cache
    assert process_data_dir(["--verify", "--cache_dir", str(cache_dir)]) == 0
    assert "cache OK: 7 items" in capsys.readouterr().out

    damaged = cache_dir / SHARD_DIR / "w0000of0001-000001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (cache_dir / SHARD_DIR / "w0000of0001-000002.safetensors").unlink()
    with pytest.raises(CacheError, match="w0000of0001-000002.safetensors is damaged: missing.*--verify"):
        CacheReader(cache_dir).read("w0000of0001-000002.safetensors", 0)

    assert process_data_dir(["--verify", "--cache_dir", str(cache_dir)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED shards/w0000of0001-000001.safetensors: checksum mismatch" in out
    assert "DAMAGED shards/w0000of0001-000002.safetensors: missing (listed in manifest/w0000of0001-000002.parquet)" in out
    assert "w0000of0001-000000" not in out

    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "3") == 0
    out = capsys.readouterr().out
    assert "repair: shards/w0000of0001-000001.safetensors is damaged (checksum mismatch" in out
    assert "cached: 4" in out and "already cached: 3" in out  # shard 1 held 3 items, shard 2 the 7th
    assert process_data_dir(["--verify", "--cache_dir", str(cache_dir)]) == 0
    assert manifest_paths(cache_dir) == Counter({f"img{index:03d}.png": 1 for index in range(7)})
    assert sorted(p.name for p in (cache_dir / "damaged").iterdir()) == [
        "w0000of0001-000001.parquet", "w0000of0001-000001.safetensors", "w0000of0001-000002.parquet"
    ]
    reader = CacheReader(cache_dir)
    for row in load_manifest(cache_dir).to_pylist():
        assert reader.read(row["shard"], row["index_in_shard"])["latents"].shape == (4, 32, 32)



def test_verify_names_a_changed_cache_info_or_empty_prompt(small_cache, capsys):
    """Both files are read by every training run: a changed byte that still parses (a digit of a setting, a
    value of the empty caption's embeddings) must fail --verify as a changed shard does."""
    _, cache_dir = small_cache
    cache_info = cache_dir / CACHE_INFO_FILE
    text = cache_info.read_bytes()
    digit = text.index(b'"max_resolution": ') + len(b'"max_resolution": ')
    cache_info.write_bytes(text[:digit] + bytes([text[digit] ^ 0x01]) + text[digit + 1:])  # 320 -> 220: still JSON
    empty_prompt = cache_dir / EMPTY_PROMPT_FILE
    data = bytearray(empty_prompt.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor: the file still loads
    empty_prompt.write_bytes(bytes(data))
    capsys.readouterr()
    assert process_data_dir(["--verify", "--cache_dir", str(cache_dir)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {CACHE_INFO_FILE}: checksum mismatch" in out
    assert f"DAMAGED {EMPTY_PROMPT_FILE}: checksum mismatch" in out
    assert "cache OK" not in out



def test_moved_cache_verifies_and_resumes(small_cache, tiny_pipeline_dir, tmp_path, capsys):
    data_dir, cache_dir = small_cache
    moved = tmp_path / "elsewhere" / "moved_cache"
    moved.parent.mkdir()
    shutil.move(str(cache_dir), str(moved))
    assert process_data_dir(["--verify", "--cache_dir", str(moved)]) == 0
    assert run_cache(data_dir, moved, tiny_pipeline_dir) == 0
    assert "already cached: 7." in capsys.readouterr().out



def test_full_disk_stops_cleanly_and_a_rerun_finishes(tmp_path, tiny_pipeline_dir, monkeypatch, capsys):
    data_dir = make_dataset(tmp_path / "data", 5)
    cache_dir = tmp_path / "cache"
    real_save_file = cache_writer.save_file
    calls = []

    def fills_up(tensors, filename):
        calls.append(filename)
        if len(calls) == 3:  # empty prompt, shard 0, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real_save_file(tensors, filename)

    monkeypatch.setattr(cache_writer, "save_file", fills_up)
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "2") == 1
    out = capsys.readouterr().out
    assert "stopped: cannot write into" in out and "the disk is full" in out and "re-run the same command" in out
    assert sum(manifest_paths(cache_dir).values()) == 2
    assert [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")] == []

    monkeypatch.setattr(cache_writer, "save_file", real_save_file)
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "2") == 0
    assert manifest_paths(cache_dir) == Counter({f"img{index:03d}.png": 1 for index in range(5)})



def test_upscaling_buckets_in_the_upscale_category_and_keeps_the_original_size(tmp_path, tiny_pipeline_dir, capsys):
    data_dir = tmp_path / "data"
    make_dataset(data_dir, 1, size=(300, 260), prefix="small")  # category 256 < 512: upscaled
    make_dataset(data_dir, 1, size=(560, 560), prefix="large")  # category 512 already
    make_dataset(data_dir, 1, size=(200, 200), prefix="tiny")  # below --min_resolution: skipped
    weights = save_weights(tiny_rrdbnet(), tmp_path / "4x_remacri_like.pth")
    cache_dir, samples = tmp_path / "cache", tmp_path / "samples"
    code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--min_resolution", "256", "--max_resolution", "512", "--upscale_to_resolution", "512", "--upscaler_weights", str(weights),
         "--upscale_tile_size", "128", "--save_upscale_samples", str(samples)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "cached: 2, upscaled: 1" in out and "skipped 1 (too small: 1)" in out
    rows = {row["image_path"]: row for row in load_manifest(cache_dir).to_pylist()}
    small, large = rows["small000.png"], rows["large000.png"]
    assert small["upscaled"] and (small["original_width"], small["original_height"]) == (300, 260)
    assert nearest_aspect_bucket(300, 260, 512) == Bucket(576, 448)  # category 512's bucket nearest to 300:260
    assert (small["bucket_width"], small["bucket_height"]) == (576, 448)
    assert not large["upscaled"] and (large["bucket_width"], large["bucket_height"]) == (512, 512)
    info = json.loads((cache_dir / CACHE_INFO_FILE).read_text())
    assert info["upscale_to_resolution"] == 512 and info["upscaler_sha256"] == sha256_file(weights)
    assert Image.open(samples / "small000.before.png").size == (300, 260)
    assert Image.open(samples / "small000.after.png").size == (1200, 1040)



def test_upscaling_without_weights_fails_before_any_work(tmp_path, capsys):
    data_dir = make_dataset(tmp_path / "data", 1)
    with pytest.raises(SystemExit):
        process_data_dir(["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), *RESOLUTION_FLAGS, "--upscale_to_resolution", "320"])
    assert "--upscale_to_resolution needs --upscaler_weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        process_data_dir(
            ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), *RESOLUTION_FLAGS, "--upscale_to_resolution", "320",
             "--upscaler_weights", str(tmp_path / "x.pth"), "--upscale_use_GFPGAN"]
        )
    err = capsys.readouterr().err
    assert "--upscaler_weights" in err and "x.pth not found" in err and "--upscale_use_GFPGAN needs --gfpgan_weights" in err
    assert "--upscale_use_GFPGAN needs --facexlib_weights_dir" in err
    assert not (tmp_path / "cache").exists()



def test_dry_run_prints_histogram_and_writes_nothing(tmp_path, capsys):
    data_dir = tmp_path / "data"
    make_dataset(data_dir, 2, size=(300, 300), prefix="square")
    make_dataset(data_dir, 1, size=(600, 300), prefix="wide")
    make_dataset(data_dir, 1, size=(100, 100), prefix="tiny")
    code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), "--min_resolution", "256", "--max_resolution", "512",
         "--upscale_to_resolution", "512", "--dry_run", "--pretrained_model_name_or_path", str(tmp_path / "no_model_needed")]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert str(nearest_aspect_bucket(600, 300, 512)) == "640x384"
    assert "    512x512  2\n    640x384  1\n" in out
    assert "would cache 3 (upscaled: 3); would skip 1 (too small: 1)" in out
    assert not (tmp_path / "cache").exists()



def test_a_cache_dir_that_holds_other_files_and_no_cache_info_is_refused_before_any_work(tmp_path, tiny_pipeline_dir, capsys):
    """--cache_dir pointing at a model folder or the user's own files: the cache wrote into it and moved the
    user's manifest/*.parquet to damaged/ as unreadable manifest parts. Refused now, untouched. A folder holding
    only what a first run killed before writing cache_info.json leaves (its worker's lock) is a cache in the making."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.cache_config import CacheConfig

    data_dir = make_dataset(tmp_path / "data", 1)
    mine = tmp_path / "my_files"
    (mine / MANIFEST_DIR).mkdir(parents=True)
    (mine / MANIFEST_DIR / "inventory.parquet").write_bytes(b"the user's table")
    (mine / "model_index.json").write_text("{}")
    before = sorted((path.relative_to(mine), path.read_bytes() if path.is_file() else None) for path in mine.rglob("*"))
    with pytest.raises(SystemExit) as refused:
        run_cache(data_dir, mine, tiny_pipeline_dir)
    assert refused.value.code == 2
    assert (
        f"--cache_dir {mine} is not empty but holds no {CACHE_INFO_FILE}, so it is no cache (it holds {MANIFEST_DIR}, model_index.json): "
        "give a new or empty folder, or an existing cache"
    ) in capsys.readouterr().err
    assert sorted((path.relative_to(mine), path.read_bytes() if path.is_file() else None) for path in mine.rglob("*")) == before
    started = tmp_path / "started"
    (started / "locks").mkdir(parents=True)
    (started / "locks" / "w0000of0001.lock").write_text("process 1 on host\n")
    argv = ["--data_dir", str(data_dir), *RESOLUTION_FLAGS]
    assert parse_config(CacheConfig, [*argv, "--cache_dir", str(started)]).cache_dir == str(started)
    (started / "locks" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        parse_config(CacheConfig, [*argv, "--cache_dir", str(started)])
    assert f"(it holds locks/notes.txt)" in capsys.readouterr().err


def test_a_folder_without_images_ends_before_any_model_loads(tmp_path, capsys):
    """Nothing to cache is said at once (the model here does not even exist), and nothing is written."""
    data_dir = tmp_path / "data"
    (data_dir / "sub").mkdir(parents=True)
    (data_dir / "notes.txt").write_text("not an image")
    (data_dir / "sub" / "orphan.mask.png").write_bytes(b"mask")  # looks like data, listed with its reason
    argv = ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(tmp_path / "no_model")]
    assert process_data_dir(argv) == 2
    out = capsys.readouterr().out
    assert f"[w0000of0001] refused: --data_dir {data_dir} holds no images (.jpg, .jpeg, .png, .webp" in out and "nothing was loaded or written" in out
    assert "skipping sub/orphan.mask.png: a mask file without an image of its name" in out
    assert not (tmp_path / "cache").exists()



def test_a_worker_whose_share_is_empty_ends_before_any_model_loads(tmp_path, capsys):
    data_dir = make_dataset(tmp_path / "data", 1)
    argv = ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(tmp_path / "no_model")]
    idle = 1 - worker_of("img000.png", 2)
    assert process_data_dir([*argv, "--num_shards", "2", "--shard_index", str(idle)]) == 0
    out = capsys.readouterr().out
    assert f"[w{idle:04d}of0002] nothing to cache: none of the 1 images in {data_dir} falls to this worker (--num_shards 2)" in out
    assert not (tmp_path / "cache").exists()



def run_launcher(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", VENV_DIR=str(Path(sys.executable).parent.parent), **env_extra)
    return subprocess.run(["bash", str(REPO_ROOT / "sdxl_process_data_dir.sh"), *args], env=env, capture_output=True, text=True, timeout=600)



def test_two_workers_split_a_folder_into_one_cache(tmp_path, tiny_pipeline_dir):
    """Workers 0 and 1 of 2, as the launcher starts them, cache disjoint parts of a folder into one cache."""
    data_dir = make_dataset(tmp_path / "data", 8)
    cache_dir = tmp_path / "cache"
    for worker in range(2):
        assert run_cache(data_dir, cache_dir, tiny_pipeline_dir, "--items_per_shard", "2", "--num_shards", "2", "--shard_index", str(worker)) == 0
    assert manifest_paths(cache_dir) == Counter({f"img{index:03d}.png": 1 for index in range(8)})
    workers = {name.split("-")[0] for name in shard_digests(cache_dir)}
    assert workers == {"w0000of0002", "w0001of0002"}



@pytest.mark.multiprocess
def test_launcher_starts_one_worker_per_shard(tmp_path):
    """NUM_WORKERS=2 starts shards 0 and 1 of 2 over the same folder (dry runs: no model loads)."""
    data_dir = make_dataset(tmp_path / "data", 8)
    result = run_launcher({"NUM_WORKERS": "2"}, "--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), *RESOLUTION_FLAGS, "--dry_run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = {worker: int(count) for worker, count in re.findall(r"\[(w\d{4}of0002)\] dry run over (\d+) images", result.stdout)}
    assert sorted(counts) == ["w0000of0002", "w0001of0002"] and sum(counts.values()) == 8 and min(counts.values()) > 0



@pytest.mark.multiprocess
def test_launcher_maps_machines_to_shards_and_fails_when_a_worker_fails(tmp_path):
    data_dir = make_dataset(tmp_path / "data", 4)
    result = run_launcher({"NUM_WORKERS": "1", "NUM_MACHINES": "3", "MACHINE_RANK": "2"}, "--data_dir", str(data_dir),
                          "--cache_dir", str(tmp_path / "cache"), *RESOLUTION_FLAGS, "--dry_run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[w0002of0003] dry run" in result.stdout
    failing = run_launcher({"NUM_WORKERS": "2"}, "--data_dir", str(tmp_path / "missing"), "--cache_dir", str(tmp_path / "cache"))
    assert failing.returncode == 1
    assert "worker 0 (shard 0 of 2) failed" in failing.stderr and "worker 1 (shard 1 of 2) failed" in failing.stderr



def test_the_vae_encodes_in_fp32_by_default_whatever_the_text_encoders_precision(tiny_pipeline_dir):
    """On a GPU the cache used to run SDXL's VAE in bf16 (encode_dtype auto); peers keep it in fp32."""
    import torch

    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.cache_config import CacheConfig
    from sdxl_trainer.models.encoders import load_encoders

    config = parse_config(CacheConfig, ["--data_dir", str(tiny_pipeline_dir), "--cache_dir", str(tiny_pipeline_dir.parent / "unused")])
    assert config.vae_dtype == "fp32"
    encoders = load_encoders(str(tiny_pipeline_dir), None, torch.device("cpu"), torch.bfloat16)  # as on a GPU: text encoders in bf16
    assert encoders.vae.dtype == torch.float32
    assert {encoder.dtype for encoder in encoders.text_encoders} == {torch.bfloat16}
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    fp32_only = load_encoders(str(tiny_pipeline_dir), None, torch.device("cpu"), torch.float32)
    assert torch.equal(encoders.encode_images(pixels), fp32_only.encode_images(pixels))
    in_bf16 = load_encoders(str(tiny_pipeline_dir), None, torch.device("cpu"), torch.bfloat16, vae_dtype=torch.bfloat16)
    difference = (in_bf16.encode_images(pixels) - fp32_only.encode_images(pixels)).abs().max().item()
    print(f"bf16 VAE latents differ from fp32 by up to {difference:.4f}")
    assert difference > 0
