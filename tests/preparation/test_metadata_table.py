"""A metadata table (JSONL or Parquet) instead of caption files: captions and tags from its rows, tag
replacements, tag exclusion, a score threshold and score tags applied, every unusable row named, rows read in
batches and split between workers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE_DATASET, SAMPLE_RESOLUTION_FLAGS, process_data_dir

from sdxl_trainer.cache.format import LOG_DIR
from sdxl_trainer.cache.reader import load_manifest
from sdxl_trainer.preparation.tables import TableError, TableFilters, parse_column_names, read_text_replacements, scan_table

ROWS = [
    {"path": "sample_00.jpg", "tags": ["1girl", "solo", "lowres", "smile"], "score": 9.0, "rating": "general"},
    {"path": "sample_01.jpg", "tags": "landscape, blue sky,  cloud", "score": 7.5, "rating": "Sensitive"},
    {"path": "sample_02.jpg", "caption": "a pink triangle\nsimple flat illustration", "score": 6.0, "rating": "general"},
    {"path": "sample_03.jpg", "tags": ["1girl", "nsfw"], "score": 9.5, "rating": "general"},  # excluded tag
    {"path": "sample_04.jpg", "tags": ["sketch"], "score": 2.0},  # score below the minimum
    {"path": "sample_05.png", "tags": ["no score"]},  # no score
    {"path": "sample_01.jpg", "tags": ["again"], "score": 8.0},  # listed twice
    {"path": "../outside.jpg", "tags": ["escape"], "score": 8.0},  # outside --data_dir
    {"path": "missing.jpg", "tags": ["gone"], "score": 8.0, "rating": "general"},  # no such image
    {"path": "sample_06.png", "score": 8.0},  # neither caption nor tags
    {"path": "rated.jpg", "tags": ["solo"], "score": 8.0, "rating": "explicit"},  # a rating not allowed
]
REPLACEMENTS = {"1girl": "one girl", "lowres": ""}


def image_folder(tmp_path: Path) -> Path:
    """The sample images without their caption files: the table is the only caption source."""
    folder = tmp_path / "images"
    folder.mkdir()
    for index in range(7):
        for image in SAMPLE_DATASET.glob(f"sample_{index:02d}.*"):
            if image.suffix != ".txt":
                shutil.copy(image, folder)
    return folder


def write_table(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        columns = {name: [row.get(name) for row in rows] for name in ("path", "tags", "caption", "score", "rating")}
        columns["tags"] = [tags if isinstance(tags, list) or tags is None else tags.split(", ") for tags in columns["tags"]]
        pq.write_table(pa.table(columns), path, row_group_size=3)  # several row groups: read in batches
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "not json\n")
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_table_caches_its_rows_with_tags_edited_and_filtered(tmp_path, tiny_pipeline_dir, suffix, capsys):
    data_dir = image_folder(tmp_path)
    table = write_table(tmp_path / f"meta{suffix}", ROWS)
    replacements = tmp_path / "replacements.json"
    replacements.write_text(json.dumps(REPLACEMENTS))
    text_replacements = tmp_path / "text_replacements.json"
    text_replacements.write_text(json.dumps({"cloud": "clouds"}))
    cache_dir = tmp_path / "cache"
    exit_code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         *SAMPLE_RESOLUTION_FLAGS, "--metadata_table", str(table),
         "--min_score", "5", "--exclude_tags", "nsfw", "--tag_replacements", str(replacements),
         "--tag_text_replacements", str(text_replacements), "--score_tags", "9", "7", "8.5", "--allowed_ratings", "General", "sensitive"]
    )
    assert exit_code == 0
    manifest = load_manifest(cache_dir)
    captions = dict(zip(manifest.column("image_path").to_pylist(), manifest.column("caption").to_pylist()))
    assert captions == {
        "sample_00.jpg": "scr9, one girl, solo, smile",
        "sample_01.jpg": "scr7, landscape, blue sky, clouds",
        "sample_02.jpg": "a pink triangle\nsimple flat illustration",  # score 6: below every threshold
    }
    log = "".join(path.read_text() for path in (cache_dir / LOG_DIR).glob("errors-*.log"))
    for expected in (
        "sample_03.jpg: has the excluded tag(s) ['nsfw'] (--exclude_tags)",
        "sample_04.jpg: score 2.0 is below --min_score 5.0",
        "sample_05.png: row 6 has no score, and --min_score 5.0 needs one",
        f"sample_01.jpg: listed again in row 7 of meta{suffix}: the first row is used",
        f"meta{suffix}:8: row 8 has no usable path ('../outside.jpg'): give one relative to --data_dir",
        "missing.jpg: cannot read the file",
        "rated.jpg: rating 'explicit' is not one of --allowed_ratings ['general', 'sensitive']",
        f"sample_06.png: row 10 of meta{suffix} has no caption (text or list of texts) or tags (list of texts or comma-separated text)",
    ):
        assert expected in log, f"{expected!r} not in the cache log:\n{log}"
    if suffix == ".jsonl":
        assert "meta.jsonl:12: row 12 not JSON" in log
    assert "skipped" in capsys.readouterr().out


def test_without_tag_edits_a_caption_is_kept_as_written(tmp_path):
    table = write_table(tmp_path / "meta.jsonl", [{"path": "a.jpg", "caption": "1girl,solo ,  smile"}])
    scan = scan_table(table, tmp_path, TableFilters(), lambda path: True)
    assert [pair.caption_text for pair in scan.pairs] == ["1girl,solo ,  smile"]


def test_the_score_tag_is_the_highest_threshold_reached_first_on_every_line(tmp_path):
    rows = [
        {"path": "a.jpg", "tags": ["solo", "smile"], "score": 950},
        {"path": "b.jpg", "caption": "red, circle\nblue, square", "score": 5000},
        {"path": "c.jpg", "tags": ["sketch"], "score": 5},
        {"path": "d.jpg", "tags": ["unscored"]},
        {"path": "e.jpg", "tags": ["lowres"], "score": 800},
        {"path": "f.jpg", "tags": ["fine"], "score": 6.5},
    ]
    filters = TableFilters(tag_replacements={"lowres": ""}, score_tags=(3200.0, 1600.0, 800.0, 6.5), score_tag_prefix="score_")
    scan = scan_table(write_table(tmp_path / "meta.jsonl", rows), tmp_path, filters, lambda path: True)
    assert {pair.relative_path: pair.caption_text for pair in scan.pairs} == {
        "a.jpg": "score_800, solo, smile",
        "b.jpg": "score_3200, red, circle\nscore_3200, blue, square",
        "c.jpg": "sketch",
        "d.jpg": "unscored",
        "e.jpg": "score_800",  # its only tag replaced by nothing
        "f.jpg": "score_6.5, fine",
    }


def test_text_replacements_edit_inside_every_tag_in_the_files_order_after_whole_tag_replacements(tmp_path):
    """002_*'s recipe: "artist:" -> "by=" before ":" -> "=" (prompt syntax reads ":" as a weight), and
    underscore tags written with spaces; the space of a replacement is kept."""
    mapping = tmp_path / "text.json"
    mapping.write_text(json.dumps({"artist:": "by=", ":": "=", "_": " ", "(": "", "sketch": ""}))
    rows = [
        {"path": "a.jpg", "tags": ["artist:lulubell", "long_hair", "rating:safe", "1girl"]},
        {"path": "b.jpg", "caption": "oc:kindle, (sketch)\nsolo_focus"},
        {"path": "c.jpg", "tags": ["kirin", "hidden_tag"]},  # excluded after the edits
    ]
    filters = TableFilters(
        excluded_tags=frozenset({"hidden tag"}), tag_replacements={"1girl": "one_girl"}, text_replacements=read_text_replacements(mapping)
    )
    scan = scan_table(write_table(tmp_path / "meta.jsonl", rows), tmp_path, filters, lambda path: True)
    assert {pair.relative_path: pair.caption_text for pair in scan.pairs} == {
        "a.jpg": "by=lulubell, long hair, rating=safe, one girl",
        "b.jpg": "oc=kindle, )\nsolo focus",
    }
    assert [problem.relative_path for problem in scan.problems if problem.category == "excluded tag"] == ["c.jpg"]


def test_only_rows_of_an_allowed_rating_are_kept_in_any_case(tmp_path):
    rows = [
        {"path": "a.jpg", "tags": "solo", "rating": "General"},
        {"path": "b.jpg", "tags": "solo", "rating": "explicit"},
        {"path": "c.jpg", "tags": "solo"},
        {"path": "d.jpg", "tags": "solo", "rating": " s "},
        {"path": "e.jpg", "tags": "solo", "rating": 3},
    ]
    filters = TableFilters(allowed_ratings=frozenset({"general", "s"}))
    scan = scan_table(write_table(tmp_path / "meta.jsonl", rows), tmp_path, filters, lambda path: True)
    assert [pair.relative_path for pair in scan.pairs] == ["a.jpg", "d.jpg"]
    assert [(problem.relative_path, problem.reason) for problem in scan.problems] == [
        ("b.jpg", "rating 'explicit' is not one of --allowed_ratings ['general', 's']"),
        ("c.jpg", "row 3 has no rating, and --allowed_ratings needs one"),
        ("e.jpg", "row 5 has no rating, and --allowed_ratings needs one"),
        ("meta.jsonl:6", "row 6 not JSON (Expecting value: line 1 column 1 (char 0)): fix the table"),
    ]


def test_a_caption_list_is_one_caption_per_line(tmp_path):
    table = write_table(tmp_path / "meta.jsonl", [{"path": "a.jpg", "caption": ["a red circle", "a flat\nillustration"]}])
    scan = scan_table(table, tmp_path, TableFilters(), lambda path: True)
    assert [pair.caption_text for pair in scan.pairs] == ["a red circle\na flat illustration"]


def test_the_dry_run_buckets_rows_by_the_tables_size_without_opening_images(tmp_path, capsys):
    rows = [
        {"path": "wide.jpg", "tags": ["a"], "width": 1280, "height": 640},
        {"path": "square.jpg", "tags": ["b"], "width": 900, "height": 900},
        {"path": "tiny.jpg", "tags": ["c"], "width": 100, "height": 100},
        {"path": "unsized.jpg", "tags": ["d"]},  # no size: the image is opened, and it does not exist
    ]
    table = write_table(tmp_path / "meta.jsonl", rows)
    (tmp_path / "images").mkdir()
    exit_code = process_data_dir(
        ["--data_dir", str(tmp_path / "images"), "--cache_dir", str(tmp_path / "cache"), "--metadata_table", str(table), "--dry_run",
         "--min_resolution", "512", "--max_resolution", "1024"]
    )
    assert exit_code == 0
    out = capsys.readouterr().out
    assert "would cache 2 (upscaled: 0); would skip 3 (bad table row: 1, too small: 1, unreadable image: 1)" in out
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_workers_split_the_rows_and_each_bad_row_is_named_once(tmp_path):
    rows = [{"path": f"folder{index % 10}/image_{index:06d}.jpg", "tags": ["tag"]} for index in range(50_000)] + [{"tags": ["no path"]}]
    table = write_table(tmp_path / "big.parquet", rows)
    from sdxl_trainer.preparation.scan import worker_of

    scans = [scan_table(table, tmp_path, TableFilters(), lambda path, worker=worker: worker_of(path, 4) == worker) for worker in range(4)]
    assert sum(len(scan.pairs) for scan in scans) == 50_000
    assert all(10_000 < len(scan.pairs) < 15_000 for scan in scans)
    assert len({pair.relative_path for scan in scans for pair in scan.pairs}) == 50_000
    named = [problem for worker, scan in enumerate(scans) for problem in scan.problems if worker_of(problem.relative_path, 4) == worker]
    assert [problem.relative_path for problem in named] == ["big.parquet:50001"]


def test_table_flags_are_checked_before_anything_loads(tmp_path, tiny_pipeline_dir, capsys):
    data_dir = image_folder(tmp_path)
    base = ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(tiny_pipeline_dir)]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('["1girl"]')
    empty_key = tmp_path / "empty_key.json"
    empty_key.write_text('{"_": " ", "": "x"}')
    for extra, message in (
        (["--min_score", "5"], "--min_score works on the rows of a --metadata_table: give one"),
        (["--score_tags", "100"], "--score_tags works on the rows of a --metadata_table: give one"),
        (["--metadata_table", str(write_table(tmp_path / "p.jsonl", ROWS)), "--score_tags", "100", "--score_tag_prefix", "a,b"],
         "--score_tag_prefix 'a,b' must hold no comma or line break"),
        (["--metadata_table", str(tmp_path / "meta.csv")], "must be an existing .jsonl or .parquet file"),
        (["--metadata_table", str(write_table(tmp_path / "m.jsonl", ROWS)), "--tag_replacements", str(bad_json)], "must be one JSON object of tag -> replacement strings"),
        (["--tag_text_replacements", str(bad_json)], "--tag_text_replacements works on the rows of a --metadata_table: give one"),
        (["--allowed_ratings", "general"], "--allowed_ratings works on the rows of a --metadata_table: give one"),
        (["--metadata_table", str(write_table(tmp_path / "t.jsonl", ROWS)), "--tag_text_replacements", str(empty_key)],
         "replaces the empty text, which is everywhere: remove that entry"),
    ):
        with pytest.raises(SystemExit):
            process_data_dir([*base, *extra])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("suffix,content", [(".parquet", b"PAR1 not really parquet"), (".jsonl", b'{"path": "a.jpg", "tags": "caf\xe9"}\n')])
def test_a_damaged_table_is_refused_naming_it(tmp_path, tiny_pipeline_dir, capsys, suffix, content):
    data_dir = image_folder(tmp_path)
    table = tmp_path / f"meta{suffix}"
    table.write_bytes(content)
    exit_code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--metadata_table", str(table)]
    )
    assert exit_code == 2
    out = capsys.readouterr().out
    assert f"refused: cannot read the metadata table {table}" in out
    assert "repair or re-export the table" in out
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_a_jsonl_table_saved_with_a_byte_order_mark_reads_its_first_row(tmp_path):
    """Windows tools (Notepad, PowerShell's UTF8 encoding) start UTF-8 files with a BOM; caption files may too."""
    table = tmp_path / "meta.jsonl"
    table.write_bytes(b"\xef\xbb\xbf" + b'{"path": "a.jpg", "tags": "solo, smile"}\r\n{"path": "b.jpg", "caption": "red"}\r\n')
    scan = scan_table(table, tmp_path, TableFilters(), lambda path: True)
    assert [(pair.relative_path, pair.caption_text) for pair in scan.pairs] == [("a.jpg", "solo, smile"), ("b.jpg", "red")]
    assert scan.problems == []


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_table_made_for_another_trainer_is_read_with_its_column_names(tmp_path, suffix):
    """SimpleTuner's Parquet tables name the image column `filename`; --table_columns maps it."""
    rows = [{"filename": "a.jpg", "text": "a red circle", "w": 640, "h": 480}, {"filename": "b.jpg", "text": "a blue square", "w": 512, "h": 512}]
    table = tmp_path / f"meta{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), table)
    else:
        table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    columns = parse_column_names(["path=filename", "caption=text", "width=w", "height=h"])
    scan = scan_table(table, tmp_path, TableFilters(), lambda path: True, columns)
    assert [(pair.relative_path, pair.caption_text, pair.table_size) for pair in scan.pairs] == [
        ("a.jpg", "a red circle", (640, 480)), ("b.jpg", "a blue square", (512, 512)),
    ]
    assert scan.problems == []
    # Without the names the table is refused at once (a JSONL table by its first row), not row by row.
    with pytest.raises(TableError, match="has no path column \\(its columns: filename, text, w, h\\).*--table_columns"):
        scan_table(table, tmp_path, TableFilters(), lambda path: True)
    if suffix == ".parquet":
        with pytest.raises(TableError, match="has no caption or tags column"):
            scan_table(table, tmp_path, TableFilters(), lambda path: True, {"path": "filename"})
    else:  # a later row without a path is named, and the rest is cached
        table.write_text("".join(json.dumps(row) + "\n" for row in [{"filename": "a.jpg", "text": "red"}, {"text": "blue"}]))
        scan = scan_table(table, tmp_path, TableFilters(), lambda path: True, columns)
        assert [pair.relative_path for pair in scan.pairs] == ["a.jpg"]
        assert [problem.reason for problem in scan.problems] == [
            "row 2 has no usable path (None): give one relative to --data_dir (a column of another name: --table_columns path=NAME)"
        ]


@pytest.mark.parametrize("pair", ["path", "file=filename", "path="])
def test_a_column_name_pair_must_name_one_of_ours(pair):
    with pytest.raises(ValueError, match="must be COLUMN=NAME_IN_THE_TABLE with COLUMN one of path, caption, tags, score, rating, width, height"):
        parse_column_names([pair])


def test_rows_whose_path_no_file_can_have_or_that_leads_outside_through_a_symlink_are_named_and_skipped(tmp_path, tiny_pipeline_dir, capsys):
    """A lone surrogate (`\\udc80` in the JSON text) cannot be encoded, a NUL cannot be in a file name, and a
    symlink inside --data_dir may lead to a file outside it: each row is named in the log, the rest cached."""
    data_dir = image_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(SAMPLE_DATASET / "sample_02.jpg", outside / "secret.jpg")
    (data_dir / "link.jpg").symlink_to(outside / "secret.jpg")
    (data_dir / "linked_folder").symlink_to(outside, target_is_directory=True)
    (data_dir / "alias.jpg").symlink_to(data_dir / "sample_00.jpg")  # a link that stays inside is fine
    rows = [
        {"path": "sample_00.jpg", "tags": ["kept"]},
        {"path": "bad\udc80name.jpg", "tags": ["surrogate"]},
        {"path": "bad\x00name.jpg", "tags": ["nul"]},
        {"path": "link.jpg", "tags": ["through a file link"]},
        {"path": "linked_folder/secret.jpg", "tags": ["through a folder link"]},
        {"path": "alias.jpg", "tags": ["inside"]},
        {"path": "sample_01.jpg", "caption": "a caption with a lone \udc80 surrogate"},  # no manifest can hold it
    ]
    table = tmp_path / "meta.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "\\udc80" in table.read_text() and "\\u0000" in table.read_text()
    cache_dir = tmp_path / "cache"
    exit_code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         *SAMPLE_RESOLUTION_FLAGS, "--metadata_table", str(table),
         "--num_shards", "1", "--shard_index", "0"]
    )
    assert exit_code == 0
    assert sorted(load_manifest(cache_dir).column("image_path").to_pylist()) == ["alias.jpg", "sample_00.jpg"]
    log = "".join(path.read_text() for path in (cache_dir / LOG_DIR).glob("errors-*.log"))
    for expected in (
        "meta.jsonl:2: row 2 has no usable path ('bad\\udc80name.jpg'): it is not valid Unicode",
        "meta.jsonl:3: row 3 has no usable path ('bad\\x00name.jpg'): it holds a NUL character",
        f"link.jpg: row 4 of meta.jsonl leads outside --data_dir through a symlink (to {outside / 'secret.jpg'})",
        f"linked_folder/secret.jpg: row 5 of meta.jsonl leads outside --data_dir through a symlink (to {outside / 'secret.jpg'})",
        "sample_01.jpg: row 7 of meta.jsonl has a caption that is not valid Unicode",
    ):
        assert expected in log, f"{expected!r} not in the cache log:\n{log}"
    assert "skipped 5 (bad table row: 3, outside --data_dir: 2)" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_empty_table_is_refused_naming_it_before_anything_is_written(tmp_path, tiny_pipeline_dir, capsys, suffix, dry_run):
    data_dir = image_folder(tmp_path)
    table = tmp_path / f"meta{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"path": pa.array([], pa.string()), "tags": pa.array([], pa.list_(pa.string()))}), table)
    else:
        table.write_text("\n  \n")  # blank lines are no rows
    cache_dir = tmp_path / "cache"
    exit_code = process_data_dir(
        ["--data_dir", str(data_dir), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
         "--metadata_table", str(table), *(["--dry_run"] if dry_run else [])]
    )
    out = capsys.readouterr().out
    assert exit_code == 2
    assert f"refused: the metadata table {table} is empty (no rows)" in out
    assert "would cache" not in out
    assert not cache_dir.exists()

