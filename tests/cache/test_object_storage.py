"""Caches in S3-compatible object storage, against a real S3 server process on localhost (tests/support/s3_server.py):
the cache script writes there what it writes to a folder, --verify and a re-run find and repair a damaged
object, reads survive a dropped connection and name a dead one, missing credentials get a clear message,
one process per worker holds a lease, and a 2-process training run from the bucket equals the same run from
a folder bit for bit."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from conftest import REPO_ROOT, SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir, run_processes, train_sample_run, trainer_flags
from s3_server import CREDENTIALS, SilentServer, make_bucket, s3_server
from safetensors.torch import load_file
from tar_shards import cache_tars, pack, sample_members

from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import CACHE_INFO_FILE, EMPTY_PROMPT_FILE, SHARD_DIR, read_cache_info
from sdxl_trainer.cache.object_lease import ObjectLease
from sdxl_trainer.cache.reader import CacheReader, load_manifest
from sdxl_trainer.cache.s3_requests import READ_TIMEOUT_VARIABLE, REQUEST_ATTEMPTS, S3FS_TRIES
from sdxl_trainer.cache.stores import open_store
from sdxl_trainer.cache.writer import WorkerLock

pytestmark = pytest.mark.multiprocess

BUCKET = "caches"


@pytest.fixture(scope="module")
def s3():
    with s3_server() as proxy:
        make_bucket(BUCKET)
        yield proxy


def cache_to(url: str, pipeline_dir, data_dir=SAMPLE_DATASET) -> int:
    return process_data_dir(
        [
            "--data_dir", str(data_dir), "--cache_dir", url, "--pretrained_model_name_or_path", str(pipeline_dir),
            *SAMPLE_RESOLUTION_FLAGS,
        ]
    )


@pytest.fixture(scope="module")
def s3_sample_cache(s3, tiny_pipeline_dir) -> str:
    """sample_dataset/ cached into the bucket with the flags of conftest's sample_cache_dir."""
    url = f"s3://{BUCKET}/sample_cache"
    assert cache_to(url, tiny_pipeline_dir) == 0
    return url


def test_the_cache_script_writes_to_object_storage_what_it_writes_to_a_folder(s3_sample_cache, sample_cache_dir, capsys):
    store = open_store(s3_sample_cache)
    local_shards = sorted(path.name for path in (sample_cache_dir / SHARD_DIR).iterdir())
    assert [name.split("/")[1] for name in store.names(SHARD_DIR, ".safetensors")] == local_shards and local_shards
    for name in [f"{SHARD_DIR}/{shard}" for shard in local_shards] + [CACHE_INFO_FILE, EMPTY_PROMPT_FILE]:
        assert store.read_bytes(name) == (sample_cache_dir / name).read_bytes(), name
    remote, local = load_manifest(s3_sample_cache), load_manifest(sample_cache_dir)
    assert remote.equals(local) and len(local) == 28
    assert store.names("locks", ".lock") == []  # the lease goes with its process
    capsys.readouterr()
    assert process_data_dir(["--verify", "--cache_dir", s3_sample_cache]) == 0
    assert "cache OK: 28 items, every shard matches its checksum" in capsys.readouterr().out


def test_verify_names_a_damaged_object_and_a_rerun_repairs_it_once_deleted(s3, tiny_pipeline_dir, tmp_path, capsys):
    url = f"s3://{BUCKET}/repaired"
    for name in ("sample_00", "sample_01", "sample_02"):
        for suffix in (".jpg", ".txt"):
            shutil.copy(SAMPLE_DATASET / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    assert cache_to(url, tiny_pipeline_dir, tmp_path) == 0
    store = open_store(url)
    shard = store.names(SHARD_DIR, ".safetensors")[0]
    original = store.read_bytes(shard)
    data = bytearray(original)
    data[-1] ^= 0xFF  # same size: only the checksum sees it
    staged = store.staging_path(shard)
    staged.write_bytes(bytes(data))
    store.publish(staged, shard)
    capsys.readouterr()
    assert process_data_dir(["--verify", "--cache_dir", url]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {shard}: checksum mismatch" in out and "Delete the damaged shards listed (a re-run checks a bucket's shards by size only)" in out
    assert cache_to(url, tiny_pipeline_dir, tmp_path) == 0  # sizes only: reading the bucket's share back would download it on every run
    assert "checked 1 shards against their sizes" in capsys.readouterr().out and store.read_bytes(shard) == bytes(data)

    store.remove(shard)  # as --verify advised
    assert cache_to(url, tiny_pipeline_dir, tmp_path) == 0
    assert f"repair: {shard} is damaged (missing)" in capsys.readouterr().out
    assert store.read_bytes(shard) == original and len(load_manifest(url)) == 3  # its items re-encoded (the name is free again)
    assert process_data_dir(["--verify", "--cache_dir", url]) == 0


def test_a_dropped_connection_is_retried_and_a_dead_one_is_named(s3, s3_sample_cache, sample_cache_dir):
    rows = load_manifest(sample_cache_dir).to_pylist()
    row = rows[3]
    other = next(candidate for candidate in rows if candidate["shard"] == row["shard"] and candidate is not row)
    expected = [CacheReader(sample_cache_dir).read(item["shard"], item["index_in_shard"]) for item in (row, other)]

    s3.cut(f"/{SHARD_DIR}/", 1)  # the header's request: cut mid-body once
    reader = CacheReader(s3_sample_cache)
    header_read = reader.read(row["shard"], row["index_in_shard"])
    s3.cut(f"/{SHARD_DIR}/", 1)  # the item's ranged request
    item_read = reader.read(other["shard"], other["index_in_shard"])
    assert s3.cuts_made == 1
    for read, wanted in zip((header_read, item_read), expected):
        assert read.keys() == wanted.keys() and all(torch.equal(read[key], wanted[key]) for key in wanted)

    s3.cut(f"/{SHARD_DIR}/", 1000)
    with pytest.raises(CacheError, match=rf"reading {s3_sample_cache}/{SHARD_DIR}/{row['shard']} failed: ClientPayloadError.*after retries"):
        CacheReader(s3_sample_cache).read(row["shard"], row["index_in_shard"])
    cuts = s3.cuts_made
    s3.cut("", 0)
    assert cuts == S3FS_TRIES  # s3fs's tries around reading a body, with backoff


def test_a_stalled_endpoint_fails_a_read_after_bounded_tries_naming_the_object_and_the_endpoint(monkeypatch):
    """An endpoint that takes the connection and never answers (a stalled proxy): s3fs alone waited 15 s per try
    and tried 125 times. The read timeout is made short here through its environment variable."""
    endpoint = SilentServer()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{endpoint.port}")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(READ_TIMEOUT_VARIABLE, "0.2")
    with pytest.raises(CacheError) as info:
        open_store("s3://caches/stalled").read_range("shards/w0-000000.safetensors", 0, 100)
    assert str(info.value) == (
        f"reading s3://caches/stalled/shards/w0-000000.safetensors failed: no answer from http://127.0.0.1:{endpoint.port} within 0.2 s "
        "(after retries): it takes connections but does not respond, as a stalled server or proxy does; check it and AWS_ENDPOINT_URL_S3, then re-run"
    )
    # botocore's tries inside s3fs's own, which a read nests twice (around the request and around reading its body)
    assert len(endpoint.requests) == S3FS_TRIES * S3FS_TRIES * REQUEST_ATTEMPTS == 12
    assert set(endpoint.requests) == {b"GET /caches/stalled/shards/w0-000000.safetensors HTTP/1.1"}


def test_a_stalled_bucket_ends_a_two_process_run_with_one_line_naming_the_object_and_the_endpoint(s3, s3_sample_cache, tiny_pipeline_dir, tmp_path, monkeypatch):
    """Every shard request stalls: the DataLoader worker's read fails after bounded tries, its error reaches the
    rank (one line, not the worker's traceback), and the watchdog ends both ranks."""
    monkeypatch.setenv(READ_TIMEOUT_VARIABLE, "1")
    s3.stall(f"/{SHARD_DIR}/")
    try:
        result = run_processes(
            2, REPO_ROOT / "sdxl_FSDP_train.py",
            trainer_flags(s3_sample_cache, tiny_pipeline_dir, tmp_path, "run", "--dataloader_num_workers", "1", "--no-validation_loss"),
            expect_success=False, timeout=300,
        )
        stalled_requests = s3.stalls_made
    finally:
        s3.stall("")
    assert result.returncode == 1 and stalled_requests >= 1
    last_line = result.stderr.rstrip().splitlines()[-1]
    assert last_line.startswith(f"reading {s3_sample_cache}/{SHARD_DIR}/") and f"no answer from http://127.0.0.1:{s3.port} within 1 s" in last_line
    assert "Traceback" not in result.stderr and "DataLoader worker" not in result.stderr, result.stderr[-3000:]


def test_missing_credentials_get_a_message_that_names_the_fix(s3, s3_sample_cache, tiny_pipeline_dir, monkeypatch, tmp_path, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(CacheError, match=rf"reading {s3_sample_cache}/{CACHE_INFO_FILE} failed: no credentials found.*AWS_ACCESS_KEY_ID"):
        read_cache_info(s3_sample_cache)
    capsys.readouterr()
    # the cache folder's check (a non-empty folder without cache_info.json is refused) meets the missing credentials first
    with pytest.raises(SystemExit) as refused:
        cache_to(f"s3://{BUCKET}/without_credentials", tiny_pipeline_dir)
    assert refused.value.code == 2
    assert "checking s3://caches/without_credentials/cache_info.json failed: no credentials found" in capsys.readouterr().err


def test_one_process_per_worker_holds_a_lease_and_a_stale_one_is_taken_over(s3):
    url = f"s3://{BUCKET}/leases"
    first = WorkerLock(url, "w0")
    with pytest.raises(CacheError, match=r"process \d+ on .* \(its lease s3://caches/leases/locks/w0.lock was renewed \d+ s ago.*is already caching worker w0"):
        WorkerLock(url, "w0")
    WorkerLock(url, "w1").release()  # another worker is free
    first.release()
    store = open_store(url)
    assert store.names("locks", ".lock") == []
    staged = store.staging_path("locks/w0.lock")
    staged.write_text(json.dumps({"holder": "process 1 on a killed machine", "token": "old", "renewed_at": time.time() - 3600}))
    store.publish(staged, "locks/w0.lock")
    taken = WorkerLock(url, "w0")
    assert json.loads(store.read_bytes("locks/w0.lock"))["holder"] != "process 1 on a killed machine"
    taken.release()


def test_a_prefix_holding_other_objects_and_no_cache_info_is_refused_as_a_cache_dir(s3, tmp_path, capsys):
    """As a folder (test_process_data_dir.py): the user's objects under the prefix are never written over or moved
    to damaged/; a prefix holding only a worker's lease is a first run stopped before cache_info.json."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.cache_config import CacheConfig

    argv = ["--data_dir", str(SAMPLE_DATASET), *SAMPLE_RESOLUTION_FLAGS, "--cache_dir"]
    store = open_store(f"s3://{BUCKET}/my_files")
    for name in ("manifest/inventory.parquet", "model_index.json"):
        staged = store.staging_path(name)
        staged.write_text("the user's")
        store.publish(staged, name)
    with pytest.raises(SystemExit):
        parse_config(CacheConfig, [*argv, store.url])
    assert (
        f"--cache_dir {store.url} is not empty but holds no {CACHE_INFO_FILE}, so it is no cache (it holds manifest, model_index.json)"
    ) in capsys.readouterr().err
    started = f"s3://{BUCKET}/started"
    lease = WorkerLock(started, "w0000of0001")  # as a killed first run leaves it
    assert parse_config(CacheConfig, [*argv, started]).cache_dir == started
    lease.release()


def steal(store, name: str, holder: str = "process 1 on another machine") -> None:
    """Another process's lease, written over this one's: what a take-over after this process stalled past LEASE_S leaves."""
    staged = store.staging_path(name)
    staged.write_text(json.dumps({"holder": holder, "token": "theirs", "renewed_at": time.time()}))
    store.publish(staged, name)


def test_a_lease_taken_over_is_not_renewed_over_and_its_holder_is_stopped(s3):
    store = open_store(f"s3://{BUCKET}/lost_lease")
    lease = ObjectLease(store, "locks/w0.lock", renew_s=0.05)
    lease.confirm()  # held: renewed now
    steal(store, "locks/w0.lock")
    time.sleep(1.0)  # some 20 renewal periods: a renewer that does not check would have written its own lease back
    assert json.loads(store.read_bytes("locks/w0.lock"))["holder"] == "process 1 on another machine"
    with pytest.raises(CacheError, match=r"the lease s3://caches/lost_lease/locks/w0.lock was taken over by process 1 on another machine, .*: stopping before its next write"):
        lease.confirm()
    lease.release()  # not its lease any more: left alone
    assert json.loads(store.read_bytes("locks/w0.lock"))["holder"] == "process 1 on another machine"


def test_two_simultaneous_take_overs_of_a_stale_lease_leave_one_holder(s3):
    url = f"s3://{BUCKET}/contested"
    store = open_store(url)
    steal(store, "locks/w0.lock", "process 1 on a killed machine")
    stale = json.loads(store.read_bytes("locks/w0.lock"))
    staged = store.staging_path("locks/w0.lock")
    staged.write_text(json.dumps({**stale, "renewed_at": time.time() - 3600}))
    store.publish(staged, "locks/w0.lock")
    winners = []
    # The first take-over's conditional write waits at the proxy while a second process takes the lease over.
    s3.before("If-Match", lambda: winners.append(WorkerLock(url, "w0")))
    with pytest.raises(CacheError, match="another process taking over the same stale lease is already caching worker w0"):
        WorkerLock(url, "w0")
    assert len(winners) == 1
    winners[0].release()  # a conditional delete: it removes the lease only as the winner wrote it
    assert store.names("locks", ".lock") == []


def test_a_caching_worker_whose_lease_is_taken_over_stops_before_its_next_commit(s3, tiny_pipeline_dir, capsys):
    url = f"s3://{BUCKET}/taken_over"
    # Once the worker sends its first manifest part, another process takes its lease over (as after a stall).
    s3.before("PUT /caches/taken_over/manifest/", lambda: steal(open_store(url), "locks/w0000of0001.lock"))
    capsys.readouterr()
    assert process_data_dir(["--data_dir", str(SAMPLE_DATASET), "--cache_dir", url, "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
                             *SAMPLE_RESOLUTION_FLAGS, "--items_per_shard", "4"]) == 1
    out = capsys.readouterr().out
    assert "stopped: the lease s3://caches/taken_over/locks/w0000of0001.lock was taken over by process 1 on another machine" in out
    store = open_store(url)
    assert len(store.names("manifest", ".parquet")) == 1  # the commit under way when the lease was lost; none after
    assert json.loads(store.read_bytes("locks/w0000of0001.lock"))["holder"] == "process 1 on another machine"


def test_tar_shards_in_a_bucket_cache_like_the_same_tars_in_a_folder(s3, tiny_pipeline_dir, tmp_path, capsys):
    members = sample_members(SAMPLE_DATASET)[:8]  # 4 samples
    folder = tmp_path / "tars"
    pack(folder / "part/a.tar", members[:4])
    pack(folder / "part/b.tar", members[4:])
    (folder / "part/broken.tar").write_bytes(b"not a tar at all" * 64)
    store = open_store(f"s3://{BUCKET}/tars")
    for path in folder.rglob("*.tar"):
        staged = store.staging_path(path.name)
        staged.write_bytes(path.read_bytes())
        store.publish(staged, path.relative_to(folder).as_posix())
    assert cache_tars(folder, tmp_path / "from_folder", tiny_pipeline_dir) == 0
    assert cache_tars(f"s3://{BUCKET}/tars", f"s3://{BUCKET}/from_tars_in_bucket", tiny_pipeline_dir) == 0
    out = capsys.readouterr().out
    assert "skipped 1 (damaged tar: 1)" in out
    log = open_store(f"s3://{BUCKET}/from_tars_in_bucket").names("logs", ".log")
    assert "part/broken.tar: cannot be read as a tar" in open_store(f"s3://{BUCKET}/from_tars_in_bucket").read_bytes(log[0]).decode()
    from_bucket, from_folder = load_manifest(f"s3://{BUCKET}/from_tars_in_bucket"), load_manifest(tmp_path / "from_folder")
    assert from_bucket.equals(from_folder) and from_bucket.column("image_path").to_pylist()[0].startswith("part/a.tar/")
    assert len(from_folder) == 4
    shard = f"{SHARD_DIR}/{from_folder.column('shard')[0].as_py()}"
    assert open_store(f"s3://{BUCKET}/from_tars_in_bucket").read_bytes(shard) == (tmp_path / "from_folder" / shard).read_bytes()


def test_two_processes_train_from_object_storage_like_from_a_folder(s3_sample_cache, runs_on_one_and_two_processes, tiny_pipeline_dir, tmp_path):
    """The folder run is test_distributed.py's (0 DataLoader workers); this one reads the bucket through 2 worker processes per rank."""
    train_sample_run(2, 1, s3_sample_cache, tiny_pipeline_dir, tmp_path, "--dataloader_num_workers", "2")
    from_bucket = load_file(tmp_path / "run" / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
    from_folder = load_file(runs_on_one_and_two_processes[2] / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
    assert from_bucket.keys() == from_folder.keys()
    assert all(torch.equal(from_bucket[key], from_folder[key]) for key in from_folder)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["cached_dataset_dirs"] == [s3_sample_cache]
