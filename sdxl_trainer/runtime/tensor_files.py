"""The safetensors format read without the safetensors library: its header checked as that library checks
it, and a file's tensors read one at a time with plain reads.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape and
[start, end) byte offsets into the data after the header; an optional "__metadata__" of strings) and the
data. Readers that decode the data themselves (a cache shard in object storage, read by ranged requests; a
model read layer by layer) must check the header first, or a damaged one decodes as wrong tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# The metadata key this project's writers mark their files with: which writer ("single_file", "lora"). The export
# tools replace an existing output only where it carries their mark (or with --overwrite).
WRITER_KEY = "sdxl_trainer.written_by"
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class DamagedHeader(ValueError):
    """A safetensors header that does not describe its data; the message says what is wrong."""


class TensorEntry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets into the data after the header
    end: int


def header_length(first_bytes: bytes) -> int:
    """The header's length from a file's first 8 bytes."""
    if len(first_bytes) < 8:
        raise DamagedHeader(f"{len(first_bytes)} bytes long, shorter than a safetensors header")
    length = int.from_bytes(first_bytes[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise DamagedHeader(f"its first 8 bytes give a header of {length} bytes: not a safetensors file")
    return length


def parse_header(header: bytes, data_bytes: int | None = None) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors and metadata a header describes, checked as safetensors checks them: every tensor's dtype
    known, its byte range as long as its dtype and shape need, the ranges in order without gap or overlap from
    the data's first byte, and (with `data_bytes`, the length of the data after the header) to its last."""
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedHeader(f"its header is not JSON ({error})") from None
    if not isinstance(entries, dict):
        raise DamagedHeader("its header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in entries.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise DamagedHeader(f"tensor {name}: its header entry {str(entry)[:100]} lacks dtype, shape or data_offsets") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise DamagedHeader(f"tensor {name}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(size, int) and size >= 0 for size in shape)):
            raise DamagedHeader(f"tensor {name}: shape {shape} is not a list of sizes")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise DamagedHeader(f"tensor {name}: data_offsets [{start}, {end}] are not a byte range")
        needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - start != needed:
            raise DamagedHeader(f"tensor {name}: its data_offsets hold {end - start} bytes, its dtype {dtype} and shape {shape} need {needed}")
        tensors[name] = TensorEntry(SAFETENSORS_DTYPES[dtype], tuple(shape), start, end)
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != position:
            raise DamagedHeader(f"tensor {name} starts at data byte {entry.start}, the tensor before it ends at {position}: the tensors overlap or leave a gap")
        position = entry.end
    if data_bytes is not None and position != data_bytes:
        raise DamagedHeader(f"its tensors end at data byte {position}, but the file holds {data_bytes} bytes of data")
    return tensors, metadata


class TensorFile:
    """A local safetensors file whose tensors are read one at a time with plain reads into fresh memory: no
    memory map, so a process reading a model of many gigabytes holds only the tensors it keeps."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as handle:
            length = header_length(handle.read(8))
            header = handle.read(length)
        if len(header) < length:
            raise DamagedHeader(f"cut short inside its header ({len(header)} of {length} bytes)")
        self.data_start = 8 + length
        self.entries, self.metadata = parse_header(header, path.stat().st_size - self.data_start)

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        data = torch.empty(entry.end - entry.start, dtype=torch.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(self.data_start + entry.start)
            if handle.readinto(data.numpy()) != data.numel():
                raise DamagedHeader(f"tensor {name}: the file was cut short while it was read")
        return data.view(entry.dtype).reshape(entry.shape)


def written_by(path: Path) -> str | None:
    """The WRITER_KEY mark in a safetensors file's metadata; None for a file without it, or no safetensors file."""
    try:
        return TensorFile(path).metadata.get(WRITER_KEY)
    except (OSError, DamagedHeader):
        return None
