"""Whether an export tool may write its --output where a file is already: it replaces a file it wrote (its
WRITER_KEY mark in the safetensors metadata says so: a re-run, or the trainer's own export), any other file only
when told to (--overwrite). Without this, a mistyped --output silently replaced someone's model or LoRA.
"""

from __future__ import annotations

from pathlib import Path

from sdxl_trainer.runtime.tensor_files import WRITER_KEY, written_by


def replace_problem(output: Path, writer: str, overwrite: bool) -> str | None:
    """Why `output` may not be written by the writer marking its files `writer` (None: it may)."""
    if output.is_dir():
        return f"--output {output} is a folder: give the file to write (.safetensors)"
    if not output.exists() or overwrite or written_by(output) == writer:
        return None
    return (
        f"--output {output} exists and was not written by this tool (its metadata has no {WRITER_KEY} = {writer}): choose another name, "
        "or add --overwrite to replace it"
    )
