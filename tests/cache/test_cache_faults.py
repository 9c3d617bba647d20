"""The cache script under the faults real machines produce: a full disk (a real one, on a small tmpfs), an
unreadable caption, a second process on the same worker, a stray temporary file, files that look like data
but are not; and the mode of what it writes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest
from caching_runs import make_dataset, run_cache
from conftest import (
    REPO_ROOT,
    SAMPLE_DATASET,
    SAMPLE_RESOLUTION_FLAGS,
    process_data_dir,
    process_env,
    small_filesystem_prefix,
    unprivileged,
)

from sdxl_trainer.cache.format import EMPTY_PROMPT_FILE
from sdxl_trainer.cache.reader import load_manifest
from sdxl_trainer.cache.writer import WorkerLock
from sdxl_trainer.runtime.files import SHAREABLE_MODE, is_disk_full, write_error_reason


@pytest.mark.multiprocess
def test_a_real_full_disk_stops_with_the_message_and_a_rerun_after_freeing_space_resumes(tmp_path, tiny_pipeline_dir):
    mounted, copied = tmp_path / "disk", tmp_path / "copied"
    command = [sys.executable, str(REPO_ROOT / "sdxl_process_data_dir.py"), "--data_dir", str(SAMPLE_DATASET), "--cache_dir", str(mounted / "cache"),
               "--pretrained_model_name_or_path", str(tiny_pipeline_dir), "--items_per_shard", "4", *SAMPLE_RESOLUTION_FLAGS]
    # Readable by the namespace's root: the tiny pipeline sits in pytest's private folder.
    result = subprocess.run([*small_filesystem_prefix(mounted, copied, "512k"), *command], cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"stopped: cannot write into {mounted / 'cache'} (the disk is full: " in result.stdout
    assert "re-run the same command to cache the rest" in result.stdout
    assert "Traceback" not in result.stderr
    committed = len(load_manifest(copied / "cache"))
    assert 0 < committed < 28
    assert not [path for path in (copied / "cache").rglob("*") if path.name.endswith(".tmp")]
    # Space freed (here: the same cache on a disk with room): the re-run caches only the rest.
    assert run_cache(SAMPLE_DATASET, copied / "cache", tiny_pipeline_dir, "--items_per_shard", "4", *SAMPLE_RESOLUTION_FLAGS) == 0
    assert len(load_manifest(copied / "cache")) == 28


def test_an_unreadable_caption_is_skipped_in_a_dry_run_with_its_reason(public_tmp_path, capsys):
    data_dir = make_dataset(public_tmp_path / "data", 3)
    dry_run = ["--data_dir", str(data_dir), "--cache_dir", str(public_tmp_path / "cache"), "--dry_run", *SAMPLE_RESOLUTION_FLAGS]
    # Once as root first: what the dry run imports lazily is then imported (the user nobody cannot read root's Python).
    assert process_data_dir(dry_run) == 0
    assert "would cache 3 (upscaled: 0); would skip 0" in capsys.readouterr().out
    (data_dir / "img001.txt").chmod(0)
    with unprivileged():
        code = process_data_dir(dry_run)
    assert code == 0
    assert "would cache 2 (upscaled: 0); would skip 1 (unreadable caption: 1)" in capsys.readouterr().out


def test_a_second_process_on_the_same_worker_is_refused(tmp_path, tiny_pipeline_dir, capsys):
    data_dir = make_dataset(tmp_path / "data", 2)
    cache_dir = tmp_path / "cache"
    holder = WorkerLock(cache_dir, "w0000of0001")
    try:
        assert run_cache(data_dir, cache_dir, tiny_pipeline_dir) == 2
        assert f"is already caching worker w0000of0001 into {cache_dir}" in capsys.readouterr().out
        assert not (cache_dir / "manifest").exists()
    finally:
        holder.release()
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir) == 0  # the lock goes with its process


def test_stray_temporary_files_of_a_killed_worker_are_removed(tmp_path, tiny_pipeline_dir):
    data_dir = make_dataset(tmp_path / "data", 2)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    stale = [cache_dir / f".{EMPTY_PROMPT_FILE}.99999.tmp", cache_dir / ".cache_info.json.99998.tmp"]
    for path in stale:
        path.write_bytes(b"left by a kill")
        an_hour_ago = time.time() - 3600
        os.utime(path, (an_hour_ago, an_hour_ago))
    assert run_cache(data_dir, cache_dir, tiny_pipeline_dir) == 0
    assert not any(path.exists() for path in stale)


def test_files_that_look_like_data_are_counted_and_named_in_the_log(tmp_path, tiny_pipeline_dir, capsys):
    data_dir = make_dataset(tmp_path / "data", 3)
    (data_dir / "gone.png").symlink_to(data_dir / "deleted.png")
    os.mkfifo(data_dir / "pipe.jpg")
    shutil.copy(data_dir / "img000.png", data_dir / "img000.jpg")  # img000.jpg takes img000.txt, img000.png is reported
    (data_dir / "img002.TXT").write_text((data_dir / "img002.txt").read_text())
    (data_dir / "img002.txt").unlink()
    assert run_cache(data_dir, tmp_path / "cache", tiny_pipeline_dir) == 0
    out = capsys.readouterr().out
    assert "skipped 3 (broken symlink: 1, duplicate name: 1, not a file: 1)" in out
    log = next((tmp_path / "cache" / "logs").glob("errors-*.log")).read_text()
    assert "gone.png: broken symlink" in log and "pipe.jpg: not a regular file" in log and "img000.png: another image has the same name (img000.jpg)" in log
    assert Counter(load_manifest(tmp_path / "cache").column("image_path").to_pylist()) == Counter(["img000.jpg", "img001.png", "img002.png"])


def test_written_files_get_the_users_usual_mode_not_safetensors_0600(tmp_path, tiny_pipeline_dir):
    data_dir = make_dataset(tmp_path / "data", 2)
    assert run_cache(data_dir, tmp_path / "cache", tiny_pipeline_dir) == 0
    modes = {path.relative_to(tmp_path / "cache").as_posix(): path.stat().st_mode & 0o777 for path in (tmp_path / "cache").rglob("*") if path.is_file()}
    assert modes and all(mode == SHAREABLE_MODE for mode in modes.values()), modes


def test_a_full_disk_is_recognised_inside_dcps_exception_of_every_rank():
    """files.py looks DCP's CheckpointException up where DCP is loaded instead of importing it (2.6 s of a
    caching dry run): wrapped by it, a full disk and another error are still told apart."""
    from torch.distributed.checkpoint.api import CheckpointException

    full = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    other = CheckpointException("save failed", {0: (ValueError("a bad shape"), None)})
    assert is_disk_full(full) and write_error_reason(full) == "the disk is full"
    assert not is_disk_full(other) and write_error_reason(other) == "ValueError: a bad shape"
