"""Caching from tar shards in the WebDataset layout (--tar_shards): the same cache as from the folder, workers
split by tar, resume, bad tars and members, dry run and verify."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

import pytest
from caching_runs import RESOLUTION_FLAGS, make_dataset
from conftest import SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir
from tar_shards import cache_tars, pack, sample_members

from sdxl_trainer.cache.format import SHARD_DIR
from sdxl_trainer.cache.reader import CacheReader, load_manifest
from sdxl_trainer.jobs import cache_job
from sdxl_trainer.preparation.tar_sources import json_caption, scan_tar_shards, split_key
from sdxl_trainer.runtime.hashing import sha256_file


def test_webdataset_keys_and_json_captions():
    assert split_key("photos/0001.jpg") == ("photos/0001", ".jpg")
    assert split_key("a.b/0001.mask.PNG") == ("a.b/0001", ".mask.png")  # the other engineer's masks are not images here
    assert json_caption('{"caption": "a cat", "url": "x"}') == "a cat"
    assert json_caption('{"text": "a dog"}') == "a dog"
    assert json_caption('{"tags": ["cat", "sofa"]}') == "cat, sofa"
    assert json_caption('{"url": "x"}') is None and json_caption("not json") is None and json_caption("[1]") is None



def test_scan_keeps_the_tar_order_and_names_what_it_cannot_use(tmp_path):
    tar = pack(tmp_path / "s.tar", [
        ("./x/a.jpg", b"A"), ("./x/a.txt", b"caption a"),  # tar -C dir -cf s.tar . writes ./ in front
        ("b.png", b"B"), ("b.jpg", b"B2"), ("b.txt", b"caption b"),  # two images of one key: .jpg first, as in folders
        ("._c.jpg", b"mac"), ("c.jpg", b"C"), ("c.txt", b"caption c"),  # macOS metadata is hidden, as in folders
        ("d.jpg", b"D"), ("d.txt", b"caption d"), ("e.webp", b"E"), ("e.json", b'{"text": "caption e"}'), ("d.png", b"D2"),
    ])
    whole = tar.read_bytes()
    scan = scan_tar_shards(tmp_path, 1, 0)
    assert [(pair.relative_path, pair.caption_text) for pair in scan.pairs] == [
        ("s.tar/x/a.jpg", "caption a"), ("s.tar/b.jpg", "caption b"), ("s.tar/c.jpg", "caption c"), ("s.tar/d.jpg", "caption d"),
        ("s.tar/e.webp", "caption e"),
    ]
    assert [pair.tar_member.read_bytes() for pair in scan.pairs] == [b"A", b"B2", b"C", b"D", b"E"]
    assert [(problem.relative_path, problem.category) for problem in scan.problems] == [
        ("s.tar/b.png", "duplicate name"), ("s.tar/d.png", "duplicate key"),
    ]
    with tarfile.open(tar) as opened:  # cut where a header starts: tarfile itself would stop there without a word
        cut_at = opened.getmember("d.jpg").offset
    tar.write_bytes(whole[:cut_at])
    scan = scan_tar_shards(tmp_path, 1, 0)
    assert [pair.relative_path for pair in scan.pairs] == ["s.tar/x/a.jpg", "s.tar/b.jpg", "s.tar/c.jpg"]
    assert [(problem.relative_path, problem.category) for problem in scan.problems] == [("s.tar", "truncated tar"), ("s.tar/b.png", "duplicate name")]
    assert "cut short after member c.txt (no end-of-archive marker" in scan.problems[0].reason



def test_members_named_outside_the_tar_are_refused_by_name(tmp_path):
    """A member name is an item's identity in the cache: one that climbs out (..) or is absolute is listed, not used."""
    pack(tmp_path / "s.tar", [
        ("../evil.jpg", b"E"), ("../evil.txt", b"caption"), ("/abs/x.jpg", b"X"), ("/abs/x.txt", b"caption"),
        ("a/../../up.jpg", b"U"), ("a/../../up.txt", b"caption"), ("ok.jpg", b"O"), ("ok.txt", b"caption ok"),
    ])
    scan = scan_tar_shards(tmp_path, 1, 0)
    assert [pair.relative_path for pair in scan.pairs] == ["s.tar/ok.jpg"]
    refused = {problem.relative_path: problem for problem in scan.problems}
    for name in ("../evil.jpg", "/abs/x.jpg", "a/../../up.jpg"):
        assert refused[f"s.tar/{name}"].category == "unsafe name", name
    assert "is absolute" in refused["s.tar//abs/x.jpg"].reason and "re-pack the tar" in refused["s.tar//abs/x.jpg"].reason
    assert "'..'" in refused["s.tar/../evil.jpg"].reason and "'..'" in refused["s.tar/a/../../up.jpg"].reason



def test_tar_cache_equals_the_folder_cache(tmp_path, sample_cache_dir, tiny_pipeline_dir, capsys):
    """sample_dataset/ packed into two tars (in the folder scan's order) caches to the same tensors and manifest
    values as the folder itself; only image_path differs, by the tar's name."""
    members = sample_members(SAMPLE_DATASET)
    half = len(members) // 4 * 2  # whole samples (image + caption) in each tar
    data_dir = tmp_path / "tars"
    shards = {"shard-00000.tar": members[:half], "shard-00001.tar": members[half:]}
    for name, shard_members in shards.items():
        pack(data_dir / name, shard_members)
    cache_dir = tmp_path / "cache"
    assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *SAMPLE_RESOLUTION_FLAGS) == 0
    assert not any(path.is_dir() for path in data_dir.iterdir())  # nothing unpacked

    folder_rows = load_manifest(sample_cache_dir).to_pylist()
    tar_rows = load_manifest(cache_dir).to_pylist()
    tar_of = {name: tar for tar, shard_members in shards.items() for name, _ in shard_members}
    assert sorted(row["image_path"] for row in tar_rows) == sorted(f"{tar_of[row['image_path']]}/{row['image_path']}" for row in folder_rows)
    folder_by_path = {row["image_path"]: row for row in folder_rows}
    folder_reader, tar_reader = CacheReader(sample_cache_dir), CacheReader(cache_dir)
    for row in tar_rows:
        folder_row = dict(folder_by_path[row["image_path"].split("/", 1)[1]])
        assert {**row, "image_path": None} == {**folder_row, "image_path": None}
        mine = tar_reader.read(row["shard"], row["index_in_shard"])
        theirs = folder_reader.read(folder_row["shard"], folder_row["index_in_shard"])
        for key, tensor in mine.items():
            assert tensor.numpy().tobytes() == theirs[key].numpy().tobytes(), (row["image_path"], key)

    capsys.readouterr()
    assert process_data_dir(["--verify", "--cache_dir", str(cache_dir)]) == 0
    assert f"cache OK: {len(tar_rows)} items" in capsys.readouterr().out



def test_two_workers_split_by_tar_and_cover_every_item_once(tmp_path, tiny_pipeline_dir, capsys):
    images = make_dataset(tmp_path / "images", 9)
    members = sample_members(images)
    data_dir = tmp_path / "tars"
    for index in range(3):  # tars 0 and 2 go to worker 0, tar 1 to worker 1
        pack(data_dir / "part" / f"{index:05d}.tar", [(f"k/{name}", path) for name, path in members[6 * index : 6 * index + 6]])
    assert {pair.relative_path.split("/")[1] for pair in scan_tar_shards(data_dir, 2, 1).pairs} == {"00001.tar"}

    cache_dir = tmp_path / "cache"
    for worker in range(2):
        assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS, "--num_shards", "2", "--shard_index", str(worker)) == 0
    manifest = load_manifest(cache_dir).to_pylist()
    assert Counter(row["image_path"] for row in manifest) == Counter(
        {f"part/{index // 3:05d}.tar/k/img{index:03d}.png": 1 for index in range(9)}
    )
    for row in manifest:  # each worker cached exactly its own tars
        tar_index = int(row["image_path"].split("/")[1][:5])
        assert row["shard"].startswith("w0001of0002" if tar_index == 1 else "w0000of0002")
        assert row["image_sha256"] == sha256_file(images / row["image_path"].split("/")[-1])

    capsys.readouterr()  # a dry run of worker 1 reads only its tar's 3 items
    assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS, "--num_shards", "2", "--shard_index", "1", "--dry_run") == 0
    out = capsys.readouterr().out
    assert "    256x256  3\n" in out and "would cache 3 (upscaled: 0); would skip 0" in out



def test_an_interrupted_run_resumes_and_a_rerun_encodes_nothing(tmp_path, tiny_pipeline_dir, monkeypatch, capsys):
    images = make_dataset(tmp_path / "images", 7)
    data_dir = tmp_path / "tars"
    pack(data_dir / "shard-00000.tar", sample_members(images))
    cache_dir = tmp_path / "cache"
    encode_chunk = cache_job.encode_chunk
    encoded: list[str] = []

    def encode_then_stop(encoders, prepared, *args):
        if len(encoded) == 4:
            raise KeyboardInterrupt  # as Ctrl-C while the third shard is being encoded
        encoded.extend(item.source.relative_path for item in prepared)
        return encode_chunk(encoders, prepared, *args)

    monkeypatch.setattr(cache_job, "encode_chunk", encode_then_stop)
    with pytest.raises(KeyboardInterrupt):
        cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS, "--items_per_shard", "2")
    finished = {path.name: (sha256_file(path), path.stat().st_mtime_ns) for path in (cache_dir / SHARD_DIR).iterdir()}
    assert len(finished) == 2 and len(load_manifest(cache_dir)) == 4

    encoded.clear()
    monkeypatch.setattr(cache_job, "encode_chunk", lambda encoders, prepared, *args: (encoded.extend(
        item.source.relative_path for item in prepared), encode_chunk(encoders, prepared, *args))[1])
    capsys.readouterr()
    assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS, "--items_per_shard", "2") == 0
    assert "already cached: 4" in capsys.readouterr().out
    assert encoded == [f"shard-00000.tar/img{index:03d}.png" for index in range(4, 7)]  # only the items not committed before
    for name, (digest, mtime) in finished.items():
        assert (sha256_file(cache_dir / SHARD_DIR / name), (cache_dir / SHARD_DIR / name).stat().st_mtime_ns) == (digest, mtime)
    assert Counter(load_manifest(cache_dir).column("image_path").to_pylist()) == Counter(
        {f"shard-00000.tar/img{index:03d}.png": 1 for index in range(7)}
    )

    encoded.clear()
    assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS, "--items_per_shard", "2") == 0
    assert encoded == [] and "already cached: 7." in capsys.readouterr().out



def test_bad_tars_and_members_are_named_and_the_rest_is_cached(tmp_path, tiny_pipeline_dir, capsys):
    images = make_dataset(tmp_path / "images", 8)
    picture = [images / f"img{index:03d}.png" for index in range(8)]
    data_dir = tmp_path / "tars"
    pack(data_dir / "a.tar", [
        ("ok0.png", picture[0]), ("ok0.json", json.dumps({"caption": "from json", "url": "x"}).encode()),
        ("nocap.png", picture[1]),  # no caption member
        ("ok1.png", picture[2]), ("ok1.txt", b"plain caption"),
        ("empty.png", picture[3]), ("empty.txt", b"  \n "),
        ("latin.png", picture[4]), ("latin.txt", "caf\xe9".encode("latin-1")),
        ("broken.png", b"not an image at all"), ("broken.txt", b"a caption"),
        ("ok1.cls", b"3"),  # ignored, as by WebDataset readers
    ])
    with tarfile.open(data_dir / "a.tar", "a") as tar:  # a symlink member named like an image
        link = tarfile.TarInfo("link.png")
        link.type, link.linkname = tarfile.SYMTYPE, "ok0.png"
        tar.addfile(link)
        tar.addfile(tarfile.TarInfo("link.txt"), io.BytesIO(b""))
    whole = pack(tmp_path / "whole.tar", [(name, path) for index in (5, 6, 7) for name, path in ((f"b/{index}.png", picture[index]), (f"b/{index}.txt", f"caption {index}".encode()))])
    with tarfile.open(whole) as tar:
        cut_at = tar.getmember("b/7.png").offset_data + 100  # inside the last image
    (data_dir / "cut.tar").write_bytes(whole.read_bytes()[:cut_at])
    (data_dir / "zero.tar").write_bytes(b"")

    cache_dir = tmp_path / "cache"
    capsys.readouterr()
    assert cache_tars(data_dir, cache_dir, tiny_pipeline_dir, *RESOLUTION_FLAGS) == 0
    out = capsys.readouterr().out
    rows = {row["image_path"]: row["caption"] for row in load_manifest(cache_dir).to_pylist()}
    assert rows == {"a.tar/ok0.png": "from json", "a.tar/ok1.png": "plain caption", "cut.tar/b/5.png": "caption 5", "cut.tar/b/6.png": "caption 6"}

    log = next((cache_dir / "logs").glob("errors-*.log")).read_text()
    for line in (
        "a.tar/nocap.png: no caption: no nocap.txt or nocap.json next to this image in the tar",
        "a.tar/empty.png: caption empty.txt is empty: write a caption",
        "a.tar/latin.png: caption latin.txt is not UTF-8",
        "a.tar/broken.png: ",
        "a.tar/link.png: not a plain file in the tar (a symlink to ok0.png)",
        "cut.tar/b/7.png: the tar is cut short inside this member (100 of its",
        "zero.tar: cannot be read as a tar (empty file)",
    ):
        assert line in log, line
    assert "copy the tar again and run the same command" in log
    assert ("skipped 7 (caption not UTF-8: 1, damaged tar: 1, empty caption: 1, missing caption: 1, not a file: 1, "
            "truncated tar: 1, unreadable image: 1)") in out

    capsys.readouterr()  # the dry run counts the same
    assert cache_tars(data_dir, tmp_path / "dry", tiny_pipeline_dir, *RESOLUTION_FLAGS, "--dry_run") == 0
    assert "would cache 4 (upscaled: 0); would skip 7" in capsys.readouterr().out



def test_tar_shards_without_tars_or_with_a_table_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        cache_tars(empty, tmp_path / "cache", tmp_path / "no_model", "--dry_run")
    assert f"--data_dir {empty} holds no .tar file" in capsys.readouterr().err
    table = tmp_path / "meta.jsonl"
    table.write_text('{"path": "a.png", "caption": "x"}\n')
    with pytest.raises(SystemExit):
        cache_tars(empty, tmp_path / "cache", tmp_path / "no_model", "--metadata_table", str(table), "--dry_run")
    assert "--tar_shards and --metadata_table are two ways to list the images: give one" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
