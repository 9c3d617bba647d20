"""Datasets packed in tar shards, in the WebDataset layout, read without unpacking them.

A sample's files are consecutive members of one tar sharing a key: the member name up to the first dot of
its last part (`0001.jpg` + `0001.txt`, `photos/0001.jpg` + `photos/0001.json`). The image is the member
whose extension is one of IMAGE_EXTENSIONS; its caption is the `.txt` member, else the `.json` member's
"caption" (or "text", or "tags") field; other members (`.cls`, `0001.mask.png`, ...) are ignored.

A tar is never extracted. The scan reads its headers (tarfile seeks over the data) and the small caption
members; an image's bytes are read later from their offset in the tar, item by item (TarMember), so memory
holds one tar's headers and the images in flight. Only uncompressed .tar files can be read by offset
(WebDataset's usual shards); a compressed one is reported as damaged, with the fix.

An item's identity in the cache (its manifest image_path, what resume compares) is the tar's path under
--data_dir and the member name: `shard-00003.tar/0001.jpg`. Workers split the tars, not the items: tar i of
the sorted list goes to worker i mod --num_shards, so each worker opens only its own tars.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import BinaryIO

from sdxl_trainer.cache.errors import StorageError
from sdxl_trainer.cache.local_store import LocalStore
from sdxl_trainer.cache.s3_store import RemoteStore
from sdxl_trainer.cache.stores import open_store
from sdxl_trainer.preparation.images import IMAGE_EXTENSIONS
from sdxl_trainer.preparation.scan import DataScan, ScanProblem, SourcePair, TarMember, normalized_caption
from sdxl_trainer.preparation.tables import outside_its_root, row_caption

TAR_SUFFIX = ".tar"


REPACK = "re-pack the tar with each sample's files next to each other"


def find_tars(data_dir: str | Path) -> list[str]:
    """Every .tar file under data_dir, a folder or an s3:// prefix (recursively, hidden names skipped), by its
    name under data_dir, sorted: the order that splits them between workers."""
    return open_store(data_dir).find(TAR_SUFFIX)


def scan_tar_shards(data_dir: str | Path, num_workers: int, worker: int) -> DataScan:
    """The samples of this worker's tars (tar i of find_tars goes to worker i mod num_workers) in the order they
    lie in the tars, so images are read front to back; what cannot be used is listed (scan_tar)."""
    store = open_store(data_dir)
    pairs: list[SourcePair] = []
    problems: list[ScanProblem] = []
    for tar_name in find_tars(store)[worker::num_workers]:
        scan = scan_tar(store, tar_name)
        pairs += scan.pairs
        problems += scan.problems
    problems.sort(key=lambda problem: problem.relative_path)
    return DataScan(pairs, problems)


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name: ("photos/0001", ".jpg") for photos/0001.jpg, ("a", ".mask.png") for
    a.mask.png; the extension in lower case."""
    folder, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return f"{folder}/{stem}" if folder else stem, f".{extension.lower()}" if dot else ""


def scan_tar(store: LocalStore | RemoteStore, label: str) -> DataScan:
    """The samples of the tar `label` (its name under --data_dir, the store), named `label/member`. Listed instead
    of used: a tar that cannot be opened or read, one cut short or damaged (the samples before the damage
    are kept), members named outside the tar (absolute or with '..'), images that are not plain files, images without a caption member or with an empty, non-UTF-8
    or unreadable one, several images of one key, and a key that appears again apart from its first files."""
    pairs: list[SourcePair] = []
    problems: list[ScanProblem] = []
    try:
        file = store.open_binary(label)
        file_size = store.size(label)
    except (OSError, StorageError) as error:
        return DataScan([], [ScanProblem(
            label, f"cannot open this tar ({getattr(error, 'strerror', None) or error}): fix its permissions", "unreadable tar",
        )])
    with file:
        try:
            tar = tarfile.open(fileobj=file, mode="r:")  # "r:": uncompressed, so members can be read by offset
        except tarfile.TarError as error:
            return DataScan([], [ScanProblem(
                label, f"cannot be read as a tar ({error}): it is damaged, empty or compressed (a .tar.gz named .tar: decompress it); "
                "copy it again or re-pack it as an uncompressed tar", "damaged tar",
            )])
        with tar:
            seen_keys: set[str] = set()
            group: list[tuple[str, str, tarfile.TarInfo]] = []  # (name, extension, member) of one key, in the tar's order
            group_key = last_name = None
            try:
                for member in tar:
                    name = member_name(member)
                    if member.offset_data + member.size > file_size:
                        problems.append(ScanProblem(
                            f"{label}/{name}",
                            f"the tar is cut short inside this member ({file_size - member.offset_data} of its {member.size} bytes are there): "
                            "the samples before it are read, those from here on are missing; copy the tar again and run the same command "
                            "to cache the rest", "truncated tar",
                        ))
                        break
                    key, extension = split_key(name)
                    unsafe = unsafe_name_reason(name)
                    if unsafe:
                        if extension in (*IMAGE_EXTENSIONS, ".txt", ".json"):  # other members are ignored anyway
                            problems.append(ScanProblem(f"{label}/{name}", unsafe, "unsafe name"))
                        continue
                    if group and key != group_key:
                        _add_sample(file, store, label, group_key, group, seen_keys, pairs, problems)
                        group = []
                    group_key, last_name = key, name
                    group.append((name, extension, member))
                else:
                    damage = _end_problem(file, tar.offset, label, last_name)
                    if damage is not None:
                        problems.append(damage)
            except (tarfile.TarError, OSError) as error:
                problems.append(ScanProblem(
                    label, f"cut short or damaged after member {last_name} ({error}): the samples before it are read; copy the tar again and run the "
                    "same command to cache the rest", "damaged tar",
                ))
            if group:
                _add_sample(file, store, label, group_key, group, seen_keys, pairs, problems)
    return DataScan(pairs, problems)


def member_name(member: tarfile.TarInfo) -> str:
    """The member's name as the item's identity, without a leading ./ (tar -C dir -cf x.tar .)."""
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    return name


def unsafe_name_reason(name: str) -> str | None:
    """Why a member name cannot name an item (None if it can): the name is the item's identity in the cache and
    in every message, so it must stay inside the tar, as an unpacked tar's files would."""
    where = outside_its_root(name)
    if where is None:
        return None
    return f"the member's name {where}: a tar member is named relative to the tar's root; re-pack the tar from its folder (tar -C folder -cf x.tar .)"


def _end_problem(file, offset: int, label: str, last_name: str | None) -> ScanProblem | None:
    """tarfile stops quietly at a header it cannot read after the first; a whole tar ends with a zero block
    there (the end-of-archive marker), so anything else is damage."""
    file.seek(offset)
    block = file.read(tarfile.BLOCKSIZE)
    if block == bytes(tarfile.BLOCKSIZE):
        return None
    after = f"after member {last_name}" if last_name else "at its start"
    if len(block) < tarfile.BLOCKSIZE:
        return ScanProblem(
            label, f"cut short {after} (no end-of-archive marker: an interrupted copy or download): the samples before it are read, "
            "any after it are missing; copy the tar again and run the same command to cache the rest", "truncated tar",
        )
    return ScanProblem(
        label, f"damaged {after} (byte {offset} is not a tar header): the samples before it are read, those after it are not read; "
        "copy the tar again and run the same command to cache the rest", "damaged tar",
    )


def _add_sample(
    file: BinaryIO, store: LocalStore | RemoteStore, label: str, key: str, group: list[tuple[str, str, tarfile.TarInfo]], seen_keys: set[str],
    pairs: list[SourcePair], problems: list[ScanProblem],
) -> None:
    """One sample (the consecutive members of one key) into pairs, or what is wrong with it into problems."""
    if key.rpartition("/")[2].startswith("."):  # ._0001.jpg (macOS metadata) and other hidden names, as in folders
        return
    images, captions = [], {}
    for name, extension, member in group:
        if extension not in (*IMAGE_EXTENSIONS, ".txt", ".json"):
            continue
        if not member.isreg() or member.issparse():
            problems.append(ScanProblem(
                f"{label}/{name}", f"not a plain file in the tar ({_kind(member)}): only file members are read; re-pack the tar with the "
                "files themselves (tar --dereference)", "not a file",
            ))
        elif extension in IMAGE_EXTENSIONS:
            images.append((IMAGE_EXTENSIONS.index(extension), name, member))
        else:
            captions.setdefault(extension, (name, member))
    if not images:
        return
    (_, image_name, chosen), *others = sorted(images, key=lambda image: image[:2])  # the first extension of IMAGE_EXTENSIONS wins, as in folders
    item = f"{label}/{image_name}"
    for _, other_name, _ in others:
        problems.append(ScanProblem(
            f"{label}/{other_name}", f"another image has the same key ({image_name}) and takes its caption: give this one its own key",
            "duplicate name",
        ))
    if key in seen_keys:
        problems.append(ScanProblem(item, f"the key {key} appears again in this tar, apart from its first files: {REPACK}", "duplicate key"))
        return
    seen_keys.add(key)
    caption_extension = ".txt" if ".txt" in captions else ".json" if ".json" in captions else None
    if caption_extension is None:
        problems.append(ScanProblem(item, f"no caption: no {key}.txt or {key}.json next to this image in the tar; add one ({REPACK})", "missing caption"))
        return
    caption_name, caption_member = captions[caption_extension]
    file.seek(caption_member.offset_data)
    raw = file.read(caption_member.size)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        problems.append(ScanProblem(item, f"caption {caption_name} is not UTF-8 ({error}): re-save it as UTF-8", "caption not UTF-8"))
        return
    if caption_extension == ".json":
        text = json_caption(text)
        if text is None:
            problems.append(ScanProblem(
                item, f"{caption_name} is not a JSON object with a \"caption\" (or \"text\") field of text, or \"tags\": fix it", "missing caption",
            ))
            return
    caption = normalized_caption(text)
    if not caption:
        problems.append(ScanProblem(item, f"caption {caption_name} is empty: write a caption", "empty caption"))
        return
    pairs.append(SourcePair(
        Path(store.location(label)) / image_name, item, caption_text=caption,  # the path shows where it came from; the bytes come from tar_member
        tar_member=TarMember(store, label, image_name, chosen.offset_data, chosen.size),
    ))


def json_caption(text: str) -> str | None:
    """The caption of a sample's .json member: its "caption" (a text or list of texts), else "text", else its
    "tags" (metadata.row_caption); None if it has none or is not a JSON object."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict):
        return None
    return row_caption({"caption": row.get("caption", row.get("text")), "tags": row.get("tags")})


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symlink to {member.linkname}"
    if member.islnk():
        return f"a hard link to {member.linkname}"
    if member.isdir():
        return "a folder"
    if member.issparse():
        return "a sparse file"
    return "a device or FIFO"
