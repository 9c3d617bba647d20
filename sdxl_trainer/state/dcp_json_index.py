"""DCP's checkpoint index as JSON instead of a pickle, and a strict reader of it.

DCP's own index (.metadata) is a pickle, read back with torch.load(weights_only=False): opening a checkpoint
could run code. Ours is JSON, and the reader refuses an index that names a non-tensor entry, an unknown dtype,
a storage transform or a file outside the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from sdxl_trainer.runtime.files import write_durably
from sdxl_trainer.state.checkpoint_layout import METADATA_FILE, SHARD_FILE, CheckpointError

DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)}


def _metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    entries = {}
    for fqn, storage in metadata.state_dict_metadata.items():
        if isinstance(storage, BytesStorageMetadata):
            raise CheckpointError(f"{fqn} is not a tensor and would be pickled: this is a bug, please report it")
        if storage.properties.layout != torch.strided:
            raise CheckpointError(f"{fqn}: only strided tensors can be checkpointed, got {storage.properties.layout}")
        entries[fqn] = {
            "dtype": str(storage.properties.dtype).removeprefix("torch."),
            "requires_grad": storage.properties.requires_grad,
            "size": list(storage.size),
            "chunks": [[list(chunk.offsets), list(chunk.sizes)] for chunk in storage.chunks],
        }
    storage_data = [
        {
            "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "index": index.index,
            "path": info.relative_path,
            "start": info.offset,
            "length": info.length,
        }
        for index, info in metadata.storage_data.items()
    ]
    meta = metadata.storage_meta or StorageMeta()
    return {
        "version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": {fqn: list(path) for fqn, path in (metadata.planner_data or {}).items()},
        "storage_data": storage_data,
        "storage_meta": {"checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id), "save_id": meta.save_id, "modules": meta.modules},
    }


def _metadata_from_json(data: dict[str, Any], index_file: Path) -> Metadata:
    """DCP's index from our JSON, refusing anything a checkpoint of ours never holds: a non-tensor entry (DCP
    would unpickle it, which can run code), an unknown dtype, a storage transform, a file outside the folder."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{index_file} is refused: {why}. This trainer never writes such a checkpoint: it was altered or made by "
            "something else. Do not resume from it; use another checkpoint (or start from an exported pipeline)."
        )

    entries: dict[str, Any] = {}
    for fqn, entry in data["state_dict_metadata"].items():
        if set(entry) != {"dtype", "requires_grad", "size", "chunks"}:
            raise refuse(f"entry {fqn!r} is not a tensor (reading it would mean unpickling it, which can run code)")
        if entry["dtype"] not in DTYPES:
            raise refuse(f"entry {fqn!r} has the unknown dtype {entry['dtype']!r}")
        properties = TensorProperties(dtype=DTYPES[entry["dtype"]], requires_grad=bool(entry["requires_grad"]))
        chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in entry["chunks"]]
        entries[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
    storage_data = {}
    for item in data["storage_data"]:
        if set(item) != {"fqn", "offset", "index", "path", "start", "length"}:
            raise refuse(f"the storage of {item.get('fqn')!r} has unexpected fields {sorted(set(item) - {'fqn', 'offset', 'index', 'path', 'start', 'length'})}")
        if not SHARD_FILE.match(str(item["path"])):
            raise refuse(f"entry {item['fqn']!r} points at {item['path']!r}, not a shard file of this checkpoint")
        if item["fqn"] not in entries:
            raise refuse(f"the storage names {item['fqn']!r}, which the index does not list")
        index = MetadataIndex(item["fqn"], None if item["offset"] is None else torch.Size(item["offset"]), item["index"])
        storage_data[index] = _StorageInfo(item["path"], int(item["start"]), int(item["length"]))
    meta = data["storage_meta"]
    return Metadata(
        state_dict_metadata=entries,
        planner_data={fqn: tuple(path) for fqn, path in data["planner_data"].items()},
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"], modules=meta["modules"]),
        version=data["version"],
    )


def read_index(checkpoint_dir: Path) -> Metadata:
    index_file = checkpoint_dir / METADATA_FILE
    try:
        data = json.loads(index_file.read_text(encoding="utf-8"))
        return _metadata_from_json(data, index_file)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_file} is damaged ({type(error).__name__}: {error})") from error


class JsonIndexWriter(FileSystemWriter):
    """DCP's file writer, with the checkpoint index written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
        metadata.storage_meta = self.storage_meta()
        write_durably(Path(self.path) / METADATA_FILE, json.dumps(_metadata_to_json(metadata)))


class JsonIndexReader(FileSystemReader):
    """Reads checkpoints written by JsonIndexWriter, through the strict index reader; a record that cannot
    be read is reported with the file that holds it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_index(Path(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:  # noqa: BLE001 - DCP's reading raises whatever torch.load or the file raised
                raise CheckpointError(f"{Path(self.path) / relative_path} could not be read ({type(error).__name__}: {error})") from error
        done: Future[None] = Future()
        done.set_result(None)
        return done
