"""Cache integrity at scale: verify, quarantine of damaged shards, the trainer-side reader refusing a damaged
shard, failed writes leaving committed work intact, settings recorded once, and a million-row manifest."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from cache_items import SETTINGS, make_item
from conftest import REPO_ROOT, run_processes, trainer_flags
from synthetic_manifest import write_manifest_cache

from sdxl_trainer.cache import writer as cache_writer
from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import (
    CACHE_INFO_FILE,
    DAMAGED_DIR,
    EMPTY_PROMPT_FILE,
    MANIFEST_DIR,
    SHARD_DIR,
    part_files,
    read_cache_info,
    write_cache_info,
)
from sdxl_trainer.cache.local_store import LocalStore
from sdxl_trainer.cache.reader import CacheReader, load_manifest, read_empty_prompt, read_manifest_parts
from sdxl_trainer.cache.s3_store import RemoteStore
from sdxl_trainer.cache.verify import shard_problem, verify_cache
from sdxl_trainer.cache.writer import ShardWriter, quarantine, write_empty_prompt


def small_cache(tmp_path, shards: int = 3, items_per_shard: int = 2):
    """A cache of `shards` shards; make_item's prompt_embeds are 77 tokens, latents fit bucket 96x64."""
    write_cache_info(tmp_path, SETTINGS)
    write_empty_prompt(tmp_path, torch.zeros(77, 64), torch.zeros(32))
    writer = ShardWriter(tmp_path, "w0")
    for shard in range(shards):
        writer.write([make_item(f"{shard}-{i}.png", shard * 10 + i) for i in range(items_per_shard)])
    return tmp_path


def flip_one_byte(path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_intact_cache(tmp_path):
    checked, problems, notes = verify_cache(small_cache(tmp_path))
    assert (checked, problems, notes) == (6, {}, {})


def test_verify_names_every_kind_of_damage(tmp_path):
    small_cache(tmp_path, shards=4)
    flip_one_byte(tmp_path / SHARD_DIR / "w0-000000.safetensors")  # same size, other bytes
    truncated = tmp_path / SHARD_DIR / "w0-000001.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (tmp_path / SHARD_DIR / "w0-000002.safetensors").unlink()
    (tmp_path / MANIFEST_DIR / "w0-000003.parquet").write_bytes(b"not parquet")
    checked, problems, _ = verify_cache(tmp_path)
    assert checked == 0
    assert set(problems) == {
        "shards/w0-000000.safetensors",
        "shards/w0-000001.safetensors",
        "shards/w0-000002.safetensors",
        "manifest/w0-000003.parquet",
        "shards/w0-000003.safetensors",  # its part is unreadable, so nothing lists it
    }
    assert "checksum mismatch" in problems["shards/w0-000000.safetensors"][0]
    assert "size 100 bytes" in problems["shards/w0-000001.safetensors"][0]
    assert problems["shards/w0-000002.safetensors"] == ["missing (listed in manifest/w0-000002.parquet)"]
    assert "unreadable manifest part" in problems["manifest/w0-000003.parquet"][0]


def test_verify_reports_a_missing_manifest_and_shards_no_part_lists(tmp_path):
    small_cache(tmp_path, shards=3)
    (tmp_path / MANIFEST_DIR / "w0-000001.parquet").unlink()  # its items would vanish silently
    checked, problems, _ = verify_cache(tmp_path)
    assert checked == 4
    assert problems == {"shards/w0-000001.safetensors": ["no manifest part lists it: its items are missing from the cache"]}
    shutil.rmtree(tmp_path / MANIFEST_DIR)
    checked, problems, _ = verify_cache(tmp_path)
    assert checked == 0
    assert problems["manifest"] == ["missing: the cache lists no items at all"]
    assert {f"shards/w0-00000{index}.safetensors" for index in range(3)} <= set(problems)


def test_verify_checks_rows_against_shard(tmp_path):
    write_cache_info(tmp_path, SETTINGS)
    write_empty_prompt(tmp_path, torch.zeros(77, 64), torch.zeros(32))
    wrong_bucket = make_item("wrong.png", 1)
    wrong_bucket.row["bucket_width"] = 128  # latents are 12 wide = 96 px, not 128
    ShardWriter(tmp_path, "w0").write([make_item("fine.png", 0), wrong_bucket])
    # A row claiming an item the shard does not hold: manifest and shard written by different code versions.
    part = tmp_path / MANIFEST_DIR / "w0-000000.parquet"
    table = pq.read_table(part)
    extra = table.slice(0, 1).to_pylist()[0] | {"image_path": "ghost.png", "index_in_shard": 7}
    pq.write_table(pa.concat_tables([table, pa.Table.from_pylist([extra], schema=table.schema)]).replace_schema_metadata(table.schema.metadata), part)
    _, problems, _ = verify_cache(tmp_path)
    assert problems == {
        "shards/w0-000000.safetensors": [
            "item 1 (wrong.png): latents (4, 8, 12) do not match bucket 128x64",
            "item 7 (ghost.png): tensors ['latents', 'prompt_embeds', 'pooled_prompt_embeds'] missing",
        ]
    }


def test_verify_checks_the_shared_files_against_the_checksums_their_parts_recorded(tmp_path):
    small_cache(tmp_path, shards=2)
    flip_one_byte(tmp_path / EMPTY_PROMPT_FILE)
    _, problems, notes = verify_cache(tmp_path)
    assert list(problems) == [EMPTY_PROMPT_FILE]
    assert problems[EMPTY_PROMPT_FILE][0].startswith("checksum mismatch (contents changed since manifest/w0-000000.parquet recorded it)")
    assert notes == {}


def test_a_cache_whose_parts_recorded_no_checksum_of_the_shared_files_says_so_and_checks_they_read(tmp_path):
    """Caches written before the checksums were recorded stay readable: --verify notes what it cannot check."""
    small_cache(tmp_path, shards=2)
    for part in (tmp_path / MANIFEST_DIR).glob("*.parquet"):
        table = pq.read_table(part)
        old_metadata = {key: value for key, value in table.schema.metadata.items() if not key.endswith(b"_sha256") or key == b"shard_sha256"}
        pq.write_table(table.replace_schema_metadata(old_metadata), part)
    checked, problems, notes = verify_cache(tmp_path)
    assert (checked, problems) == (4, {})
    assert set(notes) == {CACHE_INFO_FILE, EMPTY_PROMPT_FILE}
    assert all("no checksum recorded" in note for note in notes.values())
    (tmp_path / "other").mkdir()
    write_empty_prompt(tmp_path / "other", torch.zeros(154, 64), torch.zeros(32))  # another caption length
    shutil.copy(tmp_path / "other" / EMPTY_PROMPT_FILE, tmp_path / EMPTY_PROMPT_FILE)
    assert verify_cache(tmp_path)[1] == {EMPTY_PROMPT_FILE: [f"prompt_embeds are 154 tokens long, but {CACHE_INFO_FILE} says 77"]}
    (tmp_path / EMPTY_PROMPT_FILE).write_bytes(b"not safetensors")
    assert verify_cache(tmp_path)[1][EMPTY_PROMPT_FILE][0].startswith("unreadable")


def test_shard_problem_size_only_and_full(tmp_path):
    small_cache(tmp_path, shards=1)
    (part, _), = read_manifest_parts(tmp_path)[0]
    assert shard_problem(tmp_path, part) is None
    flip_one_byte(tmp_path / SHARD_DIR / part.shard)
    assert shard_problem(tmp_path, part, full_checksum=False) is None  # same size: only the checksum sees it
    assert "checksum mismatch" in shard_problem(tmp_path, part)


def test_quarantine_drops_rows_and_keeps_the_files(tmp_path):
    small_cache(tmp_path, shards=2)
    parts, _ = read_manifest_parts(tmp_path)
    quarantine(tmp_path, *part_files(parts[0][0]))
    quarantine(tmp_path, *part_files(parts[0][0]))  # a second worker finding the same damage: no error
    assert sorted(load_manifest(tmp_path).column("image_path").to_pylist()) == ["1-0.png", "1-1.png"]
    assert sorted(p.name for p in (tmp_path / DAMAGED_DIR).iterdir()) == ["w0-000000.parquet", "w0-000000.safetensors"]
    assert ShardWriter(tmp_path, "w0").next_seq == 2  # the damaged shard's name is not reused


def test_reader_refuses_truncated_shard_and_says_how_to_repair(tmp_path):
    small_cache(tmp_path, shards=1)
    shard = tmp_path / SHARD_DIR / "w0-000000.safetensors"
    shard.write_bytes(shard.read_bytes() + b"appended junk")
    with pytest.raises(CacheError) as info:
        CacheReader(tmp_path).read("w0-000000.safetensors", 0)
    message = str(info.value)
    assert str(shard) in message and "is damaged" in message
    assert f"--verify --cache_dir {tmp_path}" in message and "re-run the cache command" in message


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def zero_256_bytes(path) -> None:
    """Same size, other bytes: the end of the tensor data (the header, at the start, still parses)."""
    data = bytearray(path.read_bytes())
    data[-300:-44] = bytes(256)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, zero_256_bytes])
def test_the_reader_refuses_a_damaged_empty_prompt_naming_it_and_verify(tmp_path, damage):
    write_cache_info(tmp_path, SETTINGS)
    write_empty_prompt(tmp_path, torch.full((77, 64), 0.5), torch.full((32,), 0.25))  # no zero bytes to zero
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    intact = read_empty_prompt(tmp_path)
    damage(tmp_path / EMPTY_PROMPT_FILE)
    with pytest.raises(CacheError) as info:
        read_empty_prompt(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / EMPTY_PROMPT_FILE} is damaged (checksum mismatch: its contents changed since manifest/w0-000000.parquet recorded it)")
    assert f"sdxl_process_data_dir.py --verify --cache_dir {tmp_path}" in message and "delete it and re-run the cache command" in message
    assert intact[1].eq(0.25).all()


def test_an_empty_prompt_damaged_then_cached_on_is_still_refused(tmp_path):
    """A worker that caches on records the file as it finds it, damaged: its first part's record decides."""
    write_cache_info(tmp_path, SETTINGS)
    write_empty_prompt(tmp_path, torch.full((77, 64), 0.5), torch.full((32,), 0.25))
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    zero_256_bytes(tmp_path / EMPTY_PROMPT_FILE)
    ShardWriter(tmp_path, "w0").write([make_item("b.png", 1)])  # a re-run, recording the damaged file's checksum
    with pytest.raises(CacheError, match=r"is damaged \(checksum mismatch: its contents changed since manifest/w0-000000.parquet recorded it\)"):
        read_empty_prompt(tmp_path)


@pytest.mark.multiprocess
def test_the_trainer_refuses_damaged_empty_prompts_before_anything_loads_naming_each(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """Two caches, one empty prompt truncated (a raw SafetensorError before), one with 256 zeroed bytes (trained
    on silently before): both named in one refusal."""
    truncated, zeroed = tmp_path / "truncated", tmp_path / "zeroed"
    for cache_dir, damage in ((truncated, truncate), (zeroed, zero_256_bytes)):
        shutil.copytree(sample_cache_dir, cache_dir)
        damage(cache_dir / EMPTY_PROMPT_FILE)
    result = run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", trainer_flags([truncated, zeroed], tiny_pipeline_dir, tmp_path, "run"), expect_success=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Cannot start training:" in result.stderr
    for cache_dir in (truncated, zeroed):
        assert f"{cache_dir / EMPTY_PROMPT_FILE} is damaged (checksum mismatch" in result.stderr
        assert f"sdxl_process_data_dir.py --verify --cache_dir {cache_dir}`" in result.stderr
    assert not (tmp_path / "run" / "config.json").exists()  # refused before the run was built


class FolderAsBucket(RemoteStore):
    """A RemoteStore whose objects are a local folder's files: the reader's remote path without a server."""

    def __init__(self, folder):
        super().__init__("s3://bucket/cache")
        self.folder = LocalStore(folder)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.folder.read_range(name, start, end)

    def read_items(self, requests):
        spans = [tensors.span(keys) for tensors, keys in requests]
        return [tensors.decode(keys, self.read_range(tensors.name, start, end), start) for (tensors, keys), (start, end) in zip(requests, spans)]


def rewrite_header(shard, change) -> None:
    """Apply change(header dict) to a safetensors file's header, keeping its length (padded with spaces, as
    safetensors allows), so the file keeps its size and only the header is wrong."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    change(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    shard.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length :])


@pytest.mark.parametrize("damage, reason", [
    (lambda header: header["1/latents"].update(data_offsets=header["0/latents"]["data_offsets"]), "overlap or leave a gap"),  # item 0's bytes
    (lambda header: header["1/latents"].update(shape=[4, 12, 7]), "need"),
    (lambda header: header["1/latents"].update(dtype="Q8"), "unknown dtype"),
])
def test_a_damaged_header_in_object_storage_is_the_caches_error_naming_the_object(tmp_path, damage, reason):
    """Shards in a bucket are decoded from their header without safetensors: the header is checked as safetensors
    checks it (offsets contiguous and in range, sizes matching dtype and shape), so damage never decodes as data."""
    small_cache(tmp_path, shards=1)
    name = "w0-000000.safetensors"
    bucket = FolderAsBucket(tmp_path)
    sizes = {name: (tmp_path / SHARD_DIR / name).stat().st_size}
    intact = CacheReader(bucket, shard_bytes=sizes).read(name, 1)
    assert torch.equal(intact["latents"], CacheReader(tmp_path).read(name, 1)["latents"])
    rewrite_header(tmp_path / SHARD_DIR / name, damage)
    with pytest.raises(CacheError) as info:
        CacheReader(bucket, shard_bytes=sizes).read(name, 1)
    message = str(info.value)
    assert f"cache shard s3://bucket/cache/{SHARD_DIR}/{name} is damaged" in message and reason in message, message
    assert "--verify --cache_dir s3://bucket/cache" in message


def test_damaged_manifest_part_is_a_cache_error(tmp_path):
    small_cache(tmp_path, shards=1)
    (tmp_path / MANIFEST_DIR / "w0-000000.parquet").write_bytes(b"PAR1 broken")
    with pytest.raises(CacheError, match=r"w0-000000.parquet: unreadable manifest part.*--verify"):
        load_manifest(tmp_path)


def test_failed_write_keeps_committed_shards_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    writer = ShardWriter(tmp_path, "w0")
    writer.write([make_item("a.png", 0)])
    before = {p.name: p.read_bytes() for p in (tmp_path / SHARD_DIR).iterdir()}

    def disk_full(tensors, filename):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(cache_writer, "save_file", disk_full)
    with pytest.raises(OSError) as info:
        writer.write([make_item("b.png", 1)])
    assert info.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in (tmp_path / SHARD_DIR).iterdir()} == before
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []
    assert load_manifest(tmp_path).column("image_path").to_pylist() == ["a.png"]
    monkeypatch.undo()
    assert writer.write([make_item("b.png", 1)]) == f"{MANIFEST_DIR}/w0-000001.parquet"  # the failed number is reused


def test_cache_info_created_once_then_compared(tmp_path):
    write_cache_info(tmp_path, SETTINGS)
    upscaled = dataclasses.replace(SETTINGS, upscale_to_resolution=1024, upscaler_sha256="ab" * 32)
    with pytest.raises(CacheError) as info:
        write_cache_info(tmp_path, upscaled)
    message = str(info.value)
    assert "upscale_to_resolution: cache None, now 1024" in message and "upscaler_sha256" in message
    assert "choose a new --cache_dir" in message
    assert read_cache_info(tmp_path) == SETTINGS
    assert [p.name for p in tmp_path.iterdir()] == [CACHE_INFO_FILE]


def test_cache_info_without_upscale_fields_still_reads(tmp_path):
    # Caches written before upscaling existed have no upscale fields: they mean "no upscaling".
    (tmp_path / CACHE_INFO_FILE).write_text(
        '{"pretrained_model_name_or_path": "m", "vae_name_or_path": "m", "model_fingerprint": "f", "min_resolution": 512,'
        ' "max_resolution": 1024, "bucket_table_version": 1, "latent_scaling_factor": 0.13025, "text_max_length": 77, "format_version": 1}'
    )
    assert read_cache_info(tmp_path).upscale_to_resolution is None


@pytest.mark.slow
def test_million_row_manifest_loads_and_finds_items(tmp_path):
    """1,000,000 rows in parts of 256 (the default --items_per_shard), written without tensors."""
    num_rows, rows_per_part = 1_000_000, 256
    write_manifest_cache(tmp_path, num_rows, rows_per_part)  # tests/support/synthetic_manifest.py: Arrow's kernels, 1 s

    started = time.perf_counter()
    manifest = load_manifest(tmp_path)
    lookup = dict(zip(manifest.column("image_path").to_pylist(), range(len(manifest))))
    elapsed = time.perf_counter() - started
    print(f"\n1,000,000-row manifest in {num_rows // rows_per_part + 1} parts: loaded and indexed in {elapsed:.1f} s")
    assert len(manifest) == num_rows
    row = manifest.slice(lookup[f"folder{654321 % 997}/image_0654321.jpg"], 1).to_pylist()[0]
    assert (row["shard"], row["index_in_shard"]) == (f"w0-{654321 // 256:06d}.safetensors", 654321 % 256)
    assert row["caption"] == "caption 654321" and row["bucket_width"] == 654321 % 7 * 64 + 512


def test_training_on_an_empty_cache_says_so_and_how_to_fill_it(tmp_path):
    """A cache whose caching skipped every image holds its settings and no item: the run is refused naming the
    cache and how to fill it (it used to advise lowering the batch size, after the model had loaded)."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.training.training_data import load_training_data

    empty = tmp_path / "empty"
    write_cache_info(empty, SETTINGS)
    write_empty_prompt(empty, torch.zeros(77, 64), torch.zeros(32))
    full = small_cache(tmp_path / "full")
    for caches in ([empty], [full, empty]):
        settings = parse_config(TrainConfig, ["--cached_dataset_dirs", *map(str, caches)]).data_settings()
        with pytest.raises(SystemExit) as info:
            load_training_data(settings, tmp_path / "run", seed=0, world_size=1, is_main=True)
        message = str(info.value)
        assert f"Cannot start training: cache {empty} holds no items" in message, message
        assert f"sdxl_process_data_dir.py --data_dir YOUR_IMAGES --cache_dir {empty}" in message and f"{empty}/logs" in message
        assert "batch" not in message
