"""Datasets described by a table instead of caption files: one row per image, in a JSONL or Parquet file.

Columns (others are ignored):
- path: the image's path relative to --data_dir ('/'-separated), its identity in the cache; a row whose path
  leads outside --data_dir, through a symlink too, is refused;
- caption: the caption text (several captions: one per line, or a list of strings), or
- tags: a list of tags, or one comma-separated string;
- score: a number, needed where --min_score filters and read by --score_tags;
- rating: a text (e.g. general, sensitive, questionable, explicit, or g/s/q/e), needed where --allowed_ratings
  filters;
- width, height: the image's upright size in px, optional: --dry_run then buckets the row without opening
  the image (caching always reads the image's own size).
A table made for another trainer names them otherwise: --table_columns maps ours to its names.
The table is read in batches of rows (Parquet row groups / JSONL lines), and a worker keeps only its own
rows, so a table of millions of rows never sits in memory whole; images are read later, one by one.

Tag edits apply to the comma-separated tags of every caption line, in this order: replacements
(--tag_replacements: a JSON object tag -> new tag, "" removes the tag), text replacements inside every tag
(--tag_text_replacements: a JSON object text -> new text, applied in the file's order, e.g. "artist:" ->
"by=", ":" -> "=" as prompt syntax reads ":" as a weight, "_" -> " " for underscore tags; a tag left
empty is removed), then exclusion (--exclude_tags: a row with any of these tags is skipped), then the
score tag (--score_tags: the highest threshold the row's score reaches, e.g. "scr800" for a score of 950
with thresholds 3200, 1600, 800, ..., becomes the first tag of every line; a row without a score or below
every threshold gets none). Without any of them the caption is kept exactly as written. Rows are filtered
by --min_score and --allowed_ratings before their tags are edited.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

from sdxl_trainer.preparation.scan import DataScan, ScanProblem, SourcePair

TABLE_SUFFIXES = (".jsonl", ".parquet")
ROWS_PER_BATCH = 65_536
WANTED_COLUMNS = ("path", "caption", "tags", "score", "rating", "width", "height")


@dataclass(frozen=True)
class TableFilters:
    min_score: float | None = None
    allowed_ratings: frozenset[str] = frozenset()  # lower case; empty = every row, with a rating or not
    excluded_tags: frozenset[str] = frozenset()
    tag_replacements: dict[str, str] = field(default_factory=dict)  # whole tag -> tag
    text_replacements: tuple[tuple[str, str], ...] = ()  # (text, new text) inside every tag, in order
    score_tags: tuple[float, ...] = ()  # thresholds
    score_tag_prefix: str = "scr"

    @property
    def edits_tags(self) -> bool:
        return bool(self.excluded_tags or self.tag_replacements or self.text_replacements)

    def score_tag(self, score: object) -> str | None:
        """The tag for the highest threshold `score` reaches ("scr800"), None below all or without a score."""
        if not is_number(score):
            return None
        reached = [threshold for threshold in self.score_tags if score >= threshold]
        return f"{self.score_tag_prefix}{max(reached):g}" if reached else None


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def read_tag_replacements(path: Path) -> dict[str, str]:
    """--tag_replacements: a JSON object of tag -> replacement ("" removes the tag); ValueError names what is wrong."""
    mapping = _read_string_mapping(path, "--tag_replacements", "tag", '{"1girl": "one girl", "lowres": ""}')
    return {key.strip(): value.strip() for key, value in mapping.items()}


def read_text_replacements(path: Path) -> tuple[tuple[str, str], ...]:
    """--tag_text_replacements: (text, new text) pairs in the file's order, spaces kept ("_" -> " ")."""
    mapping = _read_string_mapping(path, "--tag_text_replacements", "text", '{"artist:": "by=", ":": "=", "_": " "}')
    if "" in mapping:
        raise ValueError(f"--tag_text_replacements {path} replaces the empty text, which is everywhere: remove that entry")
    return tuple(mapping.items())


def _read_string_mapping(path: Path, flag: str, key: str, example: str) -> dict[str, str]:
    try:
        mapping = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag} {path} cannot be read as JSON ({error})") from error
    if not isinstance(mapping, dict) or not all(isinstance(key, str) and isinstance(value, str) for key, value in mapping.items()):
        raise ValueError(f"{flag} {path} must be one JSON object of {key} -> replacement strings, e.g. {example}")
    return mapping


class TableError(RuntimeError):
    """The table as a whole cannot be read (damaged, unreadable, not UTF-8); the message names it."""


def parse_column_names(pairs: list[str]) -> dict[str, str]:
    """--table_columns ["path=file_name", "caption=text"] -> {"path": "file_name", "caption": "text"}; ValueError
    names a pair that is not OURS=THEIRS with OURS one of WANTED_COLUMNS."""
    names = {}
    for pair in pairs:
        ours, separator, theirs = pair.partition("=")
        if not separator or ours not in WANTED_COLUMNS or not theirs:
            raise ValueError(f"--table_columns {pair!r} must be COLUMN=NAME_IN_THE_TABLE with COLUMN one of {', '.join(WANTED_COLUMNS)}, e.g. path=file_name")
        names[ours] = theirs
    return names


def table_rows(path: Path, column_names: dict[str, str] | None = None) -> Iterator[tuple[int, dict | str]]:
    """(row number from 1, the row's wanted columns under our names) in order, read in batches; a row that
    cannot be read comes as (number, why) instead. column_names maps our column names to the table's where
    they differ (--table_columns). Raises TableError when the file itself cannot be read, when a Parquet
    table has no path column or no caption or tags column, or when a JSONL table's first row has no path."""
    names = {ours: (column_names or {}).get(ours, ours) for ours in WANTED_COLUMNS}
    try:
        yield from _read_rows(path, names)
    except (OSError, UnicodeDecodeError, pa.ArrowException) as error:
        raise TableError(
            f"cannot read the metadata table {path} ({type(error).__name__}: {error}): nothing was cached; repair or re-export the table "
            "(Parquet, or JSONL in UTF-8) and run the same command again"
        ) from error


def _read_rows(path: Path, names: dict[str, str]) -> Iterator[tuple[int, dict | str]]:
    if path.suffix == ".parquet":
        table = pq.ParquetFile(path)
        present = {ours: theirs for ours, theirs in names.items() if theirs in table.schema_arrow.names}
        if "path" not in present or not {"caption", "tags"} & set(present):
            _refuse_columns(path, "path" if "path" not in present else "caption or tags", table.schema_arrow.names)
        number = 0
        for batch in table.iter_batches(batch_size=ROWS_PER_BATCH, columns=list(present.values())):
            for row in pa.Table.from_batches([batch]).to_pylist():
                number += 1
                yield number, {ours: row[theirs] for ours, theirs in present.items()}
        return
    first_row = True
    with open(path, encoding="utf-8-sig") as lines:  # a BOM (Windows tools write one) is not part of row 1
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                yield number, f"not JSON ({error})"
                continue
            if not isinstance(row, dict):
                yield number, "not a JSON object"
                continue
            if first_row and names["path"] not in row:  # its keys are the table's columns, as a Parquet schema
                _refuse_columns(path, "path", list(row))
            first_row = False
            yield number, {ours: row[theirs] for ours, theirs in names.items() if theirs in row}


def _refuse_columns(path: Path, missing: str, columns: list[str]) -> NoReturn:
    raise TableError(
        f"the metadata table {path} has no {missing} column (its columns: {', '.join(columns)}): nothing was cached; name the "
        "table's columns with --table_columns, e.g. path=file_name caption=text"
    )


def row_caption(row: dict) -> str | None:
    """The row's caption text: `caption` (a list: one caption per line), else its `tags` joined with ", ";
    None if it has neither."""
    caption, tags = row.get("caption"), row.get("tags")
    if isinstance(caption, str):
        return caption
    if isinstance(caption, list) and caption and all(isinstance(line, str) for line in caption):
        return "\n".join(line.replace("\n", " ") for line in caption)
    if isinstance(tags, str):
        return tags
    if isinstance(tags, list) and all(isinstance(tag, str) for tag in tags):
        return ", ".join(tags)
    return None


def row_size(row: dict) -> tuple[int, int] | None:
    """(width, height) where the row gives both as positive whole numbers, else None."""
    width, height = row.get("width"), row.get("height")
    if all(is_number(side) and side > 0 and float(side).is_integer() for side in (width, height)):
        return int(width), int(height)
    return None


def edit_tags(caption: str, filters: TableFilters) -> tuple[str, list[str]]:
    """The caption with replacements applied to the tags of every line, and the excluded tags it holds."""
    lines, excluded = [], []
    for line in caption.splitlines():
        tags = [filters.tag_replacements.get(tag.strip(), tag.strip()) for tag in line.split(",")]
        for text, new_text in filters.text_replacements:
            tags = [tag.replace(text, new_text) for tag in tags]
        tags = [tag.strip() for tag in tags if tag.strip()]
        excluded += [tag for tag in tags if tag in filters.excluded_tags]
        lines.append(", ".join(tags))
    return "\n".join(lines), excluded


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (what the JSON escape \\udc80 decodes to), which no UTF-8 file
    name, tokenizer or Parquet column can take: it would stop the whole run, not just its row."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def outside_its_root(path: str) -> str | None:
    """How a relative path leaves the folder it is relative to ("is absolute", "climbs out ..."), or None."""
    if path.startswith("/"):
        return "is absolute"
    if ".." in path.split("/"):
        return "climbs out of its folder ('..')"
    return None


def unnameable_path(path: str) -> str | None:
    """Why no file can have this name (it would stop the scan: hashing it, or opening it), or None."""
    if "\0" in path:
        return "it holds a NUL character, which no file name can: fix the table"
    if not is_unicode(path):
        return "it is not valid Unicode (a lone surrogate, such as the JSON escape \\udc80): fix the table, renaming the file to a UTF-8 name"
    return None


def real_path(data_dir: str, relative_path: str, real_folders: dict[str, str]) -> str:
    """data_dir/relative_path with every symlink resolved. Rows share few folders, so each folder is resolved
    once (real_folders caches them) and a row costs one lstat of its file; strings and os.path, not pathlib,
    as this runs for every row of tables of millions."""
    path = os.path.join(data_dir, relative_path)
    if os.path.islink(path):
        return os.path.realpath(path)
    folder, _, name = relative_path.rpartition("/")
    real_folder = real_folders.get(folder)
    if real_folder is None:
        real_folder = real_folders[folder] = os.path.realpath(os.path.join(data_dir, folder))
    return os.path.join(real_folder, name)


def scan_table(table: Path, data_dir: Path, filters: TableFilters, mine: Callable[[str], bool], column_names: dict[str, str] | None = None) -> DataScan:
    """The images a table lists (only those `mine` accepts: this worker's), their captions edited as
    `filters` says; rows that cannot be used are listed with why (row number, or path where there is one),
    rows whose path leads outside data_dir through a symlink among them. column_names: our column names ->
    the table's, where they differ (table_rows). A table without any row is a TableError."""
    pairs: list[SourcePair] = []
    problems: list[ScanProblem] = []
    seen: set[str] = set()
    label = table.name
    inside_data_dir = os.path.join(os.path.realpath(data_dir), "")  # with a trailing "/": /data/x is inside /data, /database is not
    real_folders: dict[str, str] = {}
    rows_read = 0
    for number, row in table_rows(table, column_names):
        rows_read += 1
        if isinstance(row, str):
            problems.append(ScanProblem(f"{label}:{number}", f"row {number} {row}: fix the table", "bad table row"))
            continue
        path = row.get("path")
        relative = PurePosixPath(path) if isinstance(path, str) and path else None
        if relative is None or outside_its_root(path):
            hint = " (a column of another name: --table_columns path=NAME)" if path is None else ""
            problems.append(ScanProblem(f"{label}:{number}", f"row {number} has no usable path ({path!r}): give one relative to --data_dir{hint}", "bad table row"))
            continue
        unnameable = unnameable_path(path)
        if unnameable:
            problems.append(ScanProblem(f"{label}:{number}", f"row {number} has no usable path ({path!r}): {unnameable}", "bad table row"))
            continue
        relative_path = relative.as_posix()
        if not mine(relative_path):
            continue
        resolved = real_path(str(data_dir), relative_path, real_folders)
        if not os.path.join(resolved, "").startswith(inside_data_dir):
            problems.append(ScanProblem(
                relative_path, f"row {number} of {label} leads outside --data_dir through a symlink (to {resolved}): only files under "
                "--data_dir are cached; copy the file in, or point --data_dir at a folder holding it", "outside --data_dir",
            ))
            continue
        if relative_path in seen:
            problems.append(ScanProblem(relative_path, f"listed again in row {number} of {label}: the first row is used", "duplicate row"))
            continue
        seen.add(relative_path)
        caption = row_caption(row)
        if caption is None:
            problems.append(ScanProblem(
                relative_path, f"row {number} of {label} has no caption (text or list of texts) or tags (list of texts or comma-separated text)",
                "missing caption",
            ))
            continue
        if not is_unicode(caption):
            problems.append(ScanProblem(
                relative_path, f"row {number} of {label} has a caption that is not valid Unicode (a lone surrogate, such as the JSON escape "
                "\\udc80): fix the table", "bad table row",
            ))
            continue
        if filters.min_score is not None:
            score = row.get("score")
            if not is_number(score):
                problems.append(ScanProblem(relative_path, f"row {number} has no score, and --min_score {filters.min_score} needs one", "no score"))
                continue
            if score < filters.min_score:
                problems.append(ScanProblem(relative_path, f"score {score} is below --min_score {filters.min_score}", "score below minimum"))
                continue
        if filters.allowed_ratings:
            rating = row.get("rating")
            if not isinstance(rating, str) or not rating.strip():
                problems.append(ScanProblem(relative_path, f"row {number} has no rating, and --allowed_ratings needs one", "no rating"))
                continue
            if rating.strip().lower() not in filters.allowed_ratings:
                problems.append(ScanProblem(relative_path, f"rating {rating!r} is not one of --allowed_ratings {sorted(filters.allowed_ratings)}", "rating not allowed"))
                continue
        if filters.edits_tags:
            caption, excluded = edit_tags(caption, filters)
            if excluded:
                problems.append(ScanProblem(relative_path, f"has the excluded tag(s) {sorted(set(excluded))} (--exclude_tags)", "excluded tag"))
                continue
        score_tag = filters.score_tag(row.get("score"))
        if score_tag is not None:
            caption = "\n".join(", ".join(tag for tag in (score_tag, line) if tag) for line in caption.splitlines() or [""])
        pairs.append(SourcePair(data_dir / relative_path, relative_path, caption_text=caption, table_size=row_size(row)))
    if rows_read == 0:
        raise TableError(f"the metadata table {table} is empty (no rows): nothing was cached; give a table with one row per image")
    pairs.sort(key=lambda pair: pair.relative_path)
    problems.sort(key=lambda problem: problem.relative_path)
    return DataScan(pairs, problems)
