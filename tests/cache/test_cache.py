"""The latent cache: shards + manifest parts written by ShardWriter, merged by load_manifest, read by CacheReader;
cache_info.json settings checks and the empty-prompt file."""

from __future__ import annotations

import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from cache_items import SETTINGS, make_item

from sdxl_trainer.cache import writer as cache_writer
from sdxl_trainer.cache.errors import CacheError
from sdxl_trainer.cache.format import (
    CACHE_FORMAT_VERSION,
    CACHE_INFO_FILE,
    EMPTY_PROMPT_FILE,
    MANIFEST_DIR,
    MANIFEST_SCHEMA,
    SHARD_DIR,
    CachedItem,
    read_cache_info,
    settings_differences,
    write_cache_info,
)
from sdxl_trainer.cache.reader import CacheReader, load_manifest, read_empty_prompt
from sdxl_trainer.cache.writer import ShardWriter, write_empty_prompt
from sdxl_trainer.runtime.hashing import sha256_file

# --- helpers ----------------------------------------------------------------------------------------------


def fake_clock(monkeypatch, start: int = 1_000) -> None:
    """Make ShardWriter's written_at_ns a counter: 1000, 1001, ... in call order."""
    ticks = iter(range(start, start + 10_000))
    monkeypatch.setattr(cache_writer, "time", types.SimpleNamespace(time_ns=lambda: next(ticks)))



def rows_by_path(table) -> dict[str, dict]:
    return {row["image_path"]: row for row in table.to_pylist()}



def assert_item_matches(tensors: dict[str, torch.Tensor], item: CachedItem) -> None:
    assert tensors["latents"].dtype == torch.float16
    assert torch.equal(tensors["latents"], item.latents.half())
    assert torch.equal(tensors["prompt_embeds"], item.prompt_embeds.half())
    assert torch.equal(tensors["pooled_prompt_embeds"], item.pooled_prompt_embeds.half())



def test_round_trip_two_shards(tmp_path):
    items = [make_item(f"img/{i}.png", seed=i) for i in range(5)]
    writer = ShardWriter(tmp_path, "w0")
    first = writer.write(items[:3])
    second = writer.write(items[3:])
    assert first == f"{MANIFEST_DIR}/w0-000000.parquet"  # relative to the cache
    assert second == f"{MANIFEST_DIR}/w0-000001.parquet"
    assert sorted(p.name for p in (tmp_path / SHARD_DIR).iterdir()) == ["w0-000000.safetensors", "w0-000001.safetensors"]

    manifest = load_manifest(tmp_path)
    assert manifest.schema.names == MANIFEST_SCHEMA.names
    rows = manifest.to_pylist()
    assert [row["image_path"] for row in rows] == [f"img/{i}.png" for i in range(5)]
    assert [row["shard"] for row in rows] == ["w0-000000.safetensors"] * 3 + ["w0-000001.safetensors"] * 2
    assert [row["index_in_shard"] for row in rows] == [0, 1, 2, 0, 1]
    for row, item in zip(rows, items):
        assert {key: row[key] for key in item.row} == item.row

    reader = CacheReader(tmp_path)
    for row, item in zip(rows, items):
        assert_item_matches(reader.read(row["shard"], row["index_in_shard"]), item)



def test_fp16_storage_is_lossy_but_close(tmp_path):
    item = make_item("a.png", seed=1)
    item.latents = item.latents * 1.0001 + 1e-4  # values not representable in fp16
    ShardWriter(tmp_path, "w0").write([item])
    latents = CacheReader(tmp_path).read("w0-000000.safetensors", 0)["latents"]
    assert torch.allclose(latents.float(), item.latents, atol=1e-2)
    assert torch.equal(latents, item.latents.half())



def test_manifest_records_shard_checksum(tmp_path):
    import pyarrow.parquet as pq

    part = ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    metadata = pq.read_schema(tmp_path / part).metadata
    shard = tmp_path / SHARD_DIR / "w0-000000.safetensors"
    assert metadata[b"shard"] == b"w0-000000.safetensors"
    assert metadata[b"shard_sha256"].decode() == sha256_file(shard)
    assert int(metadata[b"shard_bytes"]) == shard.stat().st_size



def test_two_writers_are_merged(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0), make_item("b.png", 1)])
    ShardWriter(tmp_path, "w1").write([make_item("c.png", 2)])
    rows = rows_by_path(load_manifest(tmp_path))
    assert set(rows) == {"a.png", "b.png", "c.png"}
    assert rows["c.png"]["shard"] == "w1-000000.safetensors" and rows["c.png"]["index_in_shard"] == 0
    assert rows["b.png"]["shard"] == "w0-000000.safetensors" and rows["b.png"]["index_in_shard"] == 1
    reader = CacheReader(tmp_path)
    assert_item_matches(reader.read("w1-000000.safetensors", 0), make_item("c.png", 2))



def test_empty_cache_has_empty_manifest(tmp_path):
    assert len(load_manifest(tmp_path)) == 0
    ShardWriter(tmp_path, "w0")  # creates the folders, writes nothing
    manifest = load_manifest(tmp_path)
    assert len(manifest) == 0 and manifest.schema.names == MANIFEST_SCHEMA.names



def test_writer_resumes_numbering(tmp_path):
    writer = ShardWriter(tmp_path, "w0")
    writer.write([make_item("a.png", 0)])
    writer.write([make_item("b.png", 1)])
    ShardWriter(tmp_path, "w1").write([make_item("c.png", 2)])
    resumed = ShardWriter(tmp_path, "w0")
    assert resumed.next_seq == 2
    assert resumed.write([make_item("d.png", 3)]) == f"{MANIFEST_DIR}/w0-000002.parquet"
    assert ShardWriter(tmp_path, "w1").next_seq == 1
    assert ShardWriter(tmp_path, "w2").next_seq == 0
    assert len(load_manifest(tmp_path)) == 4



@pytest.mark.parametrize("older,newer", [("w1", "w0"), ("w0", "w1")])
def test_latest_written_row_wins(tmp_path, monkeypatch, older, newer):
    # Write order, not file-name order, decides: whichever worker wrote last wins.
    fake_clock(monkeypatch)
    ShardWriter(tmp_path, older).write([make_item("same.png", 1, caption="old caption"), make_item("other.png", 2)])
    ShardWriter(tmp_path, newer).write([make_item("same.png", 3, caption="new caption")])
    manifest = load_manifest(tmp_path)
    rows = rows_by_path(manifest)
    assert len(manifest) == 2
    assert rows["same.png"]["caption"] == "new caption"
    assert rows["same.png"]["shard"] == f"{newer}-000000.safetensors"
    assert rows["other.png"]["shard"] == f"{older}-000000.safetensors"
    tensors = CacheReader(tmp_path).read(rows["same.png"]["shard"], rows["same.png"]["index_in_shard"])
    assert_item_matches(tensors, make_item("same.png", 3))



def test_latest_row_wins_within_one_writer(tmp_path):
    writer = ShardWriter(tmp_path, "w0")
    writer.write([make_item("a.png", 0, caption="first"), make_item("b.png", 1)])
    writer.write([make_item("a.png", 5, caption="edited")])
    rows = rows_by_path(load_manifest(tmp_path))
    assert rows["a.png"]["caption"] == "edited"
    assert (rows["a.png"]["shard"], rows["a.png"]["index_in_shard"]) == ("w0-000001.safetensors", 0)
    assert rows["b.png"]["shard"] == "w0-000000.safetensors"



def test_unfinished_writes_are_ignored(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    # A crash mid-write leaves a stray temporary manifest part and/or a shard without a manifest part.
    (tmp_path / MANIFEST_DIR / ".w0-000001.parquet.12345.tmp").write_bytes(b"half a parquet file")
    shutil.copy(tmp_path / SHARD_DIR / "w0-000000.safetensors", tmp_path / SHARD_DIR / "w0-000001.safetensors")
    (tmp_path / SHARD_DIR / ".w0-000002.safetensors.12345.tmp").write_bytes(b"junk")
    (tmp_path / SHARD_DIR / "w1-000000.safetensors").write_bytes(b"another worker's shard, being written")
    manifest = load_manifest(tmp_path)
    assert manifest.column("shard").to_pylist() == ["w0-000000.safetensors"]
    # The orphan shard does not count as written: the next write reuses its name. A new run of the same
    # worker deletes its own leftovers, and only those.
    assert ShardWriter(tmp_path, "w0").next_seq == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["w0-000000.parquet", "w0-000000.safetensors", "w1-000000.safetensors"]



def test_no_temporary_files_left_after_write(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    write_empty_prompt(tmp_path, torch.zeros(77, 64), torch.zeros(32))
    write_cache_info(tmp_path, SETTINGS)
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []



def test_corrupted_shard_raises_cache_error_naming_the_file(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    shard = tmp_path / SHARD_DIR / "w0-000000.safetensors"
    shard.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CacheError, match="w0-000000.safetensors") as info:
        CacheReader(tmp_path).read("w0-000000.safetensors", 0)
    assert "sdxl_process_data_dir.py" in str(info.value)



def test_truncated_shard_raises_cache_error(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0), make_item("b.png", 1)])
    shard = tmp_path / SHARD_DIR / "w0-000000.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CacheError, match="w0-000000.safetensors"):
        reader = CacheReader(tmp_path)
        reader.read("w0-000000.safetensors", 0)
        reader.read("w0-000000.safetensors", 1)



def test_missing_shard_or_item_raises_cache_error(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    reader = CacheReader(tmp_path)
    with pytest.raises(CacheError, match="w0-000099.safetensors"):
        reader.read("w0-000099.safetensors", 0)
    with pytest.raises(CacheError, match="item 5 of cache shard"):
        reader.read("w0-000000.safetensors", 5)



def test_reader_with_few_open_shards_still_reads_everything(tmp_path):
    writer = ShardWriter(tmp_path, "w0")
    items = [make_item(f"{i}.png", i) for i in range(4)]
    for item in items:
        writer.write([item])
    reader = CacheReader(tmp_path, max_open_shards=2)
    for _ in range(2):
        for seq, item in enumerate(items):
            assert_item_matches(reader.read(f"w0-{seq:06d}.safetensors", 0), item)
    assert len(reader._open_shards) == 2



def test_cache_folder_can_be_moved(tmp_path):
    original = tmp_path / "first" / "cache"
    items = [make_item("a.png", 0), make_item("b.png", 1)]
    ShardWriter(original, "w0").write(items)
    write_cache_info(original, SETTINGS)
    write_empty_prompt(original, torch.ones(77, 64), torch.ones(32))

    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(str(original), str(moved))
    assert not original.exists()

    rows = load_manifest(moved).to_pylist()
    reader = CacheReader(moved)
    for row, item in zip(rows, items):
        assert_item_matches(reader.read(row["shard"], row["index_in_shard"]), item)
    assert read_cache_info(moved) == SETTINGS
    assert torch.equal(read_empty_prompt(moved)[1], torch.ones(32, dtype=torch.float16))



def test_cache_info_round_trip_and_same_settings_again(tmp_path):
    write_cache_info(tmp_path / "c", SETTINGS)
    assert read_cache_info(tmp_path / "c") == SETTINGS
    write_cache_info(tmp_path / "c", SETTINGS)  # same settings: accepted
    saved = json.loads((tmp_path / "c" / CACHE_INFO_FILE).read_text())
    assert saved["max_resolution"] == 1024 and saved["format_version"] == CACHE_FORMAT_VERSION



def test_cache_info_with_other_settings_is_refused(tmp_path):
    write_cache_info(tmp_path, SETTINGS)
    other = dataclasses.replace(SETTINGS, max_resolution=768)
    with pytest.raises(CacheError) as info:
        write_cache_info(tmp_path, other)
    message = str(info.value)
    assert "max_resolution: cache 1024, now 768" in message
    assert "min_resolution" not in message
    assert read_cache_info(tmp_path) == SETTINGS  # unchanged



def test_settings_differences():
    other = dataclasses.replace(SETTINGS, max_resolution=768, vae_name_or_path="other/vae")
    assert settings_differences(SETTINGS, SETTINGS) == []
    assert settings_differences(SETTINGS, other) == [
        "vae_name_or_path: cache 'some/sdxl', now 'other/vae'",
        "max_resolution: cache 1024, now 768",
    ]
    assert settings_differences(SETTINGS, other, fields=("max_resolution", "min_resolution")) == ["max_resolution: cache 1024, now 768"]
    assert settings_differences(SETTINGS, other, fields=("min_resolution",)) == []



def test_read_cache_info_missing(tmp_path):
    with pytest.raises(CacheError, match="sdxl_process_data_dir.py") as info:
        read_cache_info(tmp_path / "no_such_cache")
    assert "cache_info.json" in str(info.value)



@pytest.mark.parametrize("content", ["{not json", json.dumps({"unknown_field": 1})])
def test_read_cache_info_damaged(tmp_path, content):
    (tmp_path / CACHE_INFO_FILE).write_text(content)
    with pytest.raises(CacheError, match="damaged or from another version"):
        read_cache_info(tmp_path)



def test_empty_prompt_round_trip(tmp_path):
    prompt_embeds = torch.randn(77, 64, generator=torch.Generator().manual_seed(0))
    pooled = torch.randn(32, generator=torch.Generator().manual_seed(1))
    write_empty_prompt(tmp_path, prompt_embeds, pooled)
    read_prompt, read_pooled = read_empty_prompt(tmp_path)
    assert read_prompt.dtype == torch.float16 and read_prompt.shape == (77, 64)
    assert torch.equal(read_prompt, prompt_embeds.half())
    assert torch.equal(read_pooled, pooled.half())



def test_empty_prompt_written_once_and_missing(tmp_path):
    with pytest.raises(CacheError, match="sdxl_process_data_dir.py"):
        read_empty_prompt(tmp_path)
    write_empty_prompt(tmp_path, torch.zeros(77, 64), torch.zeros(32))
    # A second worker (same settings, so same tensors) does not rewrite the file the first one made.
    write_empty_prompt(tmp_path, torch.ones(77, 64), torch.ones(32))
    assert torch.equal(read_empty_prompt(tmp_path)[0], torch.zeros(77, 64, dtype=torch.float16))
    assert [p.name for p in tmp_path.iterdir()] == [EMPTY_PROMPT_FILE]



def test_paths_in_cache_are_relative(tmp_path):
    ShardWriter(tmp_path, "w0").write([make_item("a.png", 0)])
    shard_names = load_manifest(tmp_path).column("shard").to_pylist()
    assert shard_names == ["w0-000000.safetensors"]
    assert not any(Path(name).is_absolute() or "/" in name for name in shard_names)
