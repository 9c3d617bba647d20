"""Every rank's torch / CUDA / numpy / Python RNG states, saved into and restored from `rng/rank<R>.safetensors`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy_file
from safetensors.numpy import save_file as save_numpy_file

from sdxl_trainer.runtime.files import make_shareable


def rng_file_name(rank: int) -> str:
    return f"rng/rank{rank}.safetensors"


def rng_file(checkpoint_dir: Path, rank: int) -> Path:
    return checkpoint_dir / rng_file_name(rank)


def seed_global_generators(seed: int) -> None:
    """Seed torch's (CPU and every GPU), NumPy's and Python's global generators, the ones a checkpoint saves and
    restore_rng_states restores. The trainer's own draws use generators of their own; this makes a library that
    draws from the global ones repeat with --set_seed too. NumPy's global generator takes 32 bits."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def current_rng_states() -> tuple[dict[str, np.ndarray], str]:
    """This process's torch / CUDA / numpy / Python RNG states, as arrays and a JSON note of the rest."""
    algorithm, numpy_keys, numpy_position, has_gauss, cached_gauss = np.random.get_state()
    python_version, python_state, python_gauss = random.getstate()
    arrays = {
        "torch": torch.get_rng_state().numpy(),
        "numpy_keys": np.asarray(numpy_keys, dtype=np.uint32),
        "python_state": np.asarray(python_state, dtype=np.uint64),
    }
    if torch.cuda.is_available():
        arrays["torch_cuda"] = torch.cuda.get_rng_state().numpy()
    details = {"numpy": [algorithm, int(numpy_position), int(has_gauss), float(cached_gauss)], "python": [python_version, python_gauss]}
    return arrays, json.dumps(details)


def write_rng_states(path: Path, arrays: dict[str, np.ndarray], details: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_numpy_file(arrays, str(path), metadata={"details": details})
    make_shareable(path)


def restore_rng_states(path: Path) -> None:
    arrays = load_numpy_file(str(path))
    with safe_open(str(path), framework="numpy") as handle:
        details = json.loads(handle.metadata()["details"])
    torch.set_rng_state(torch.from_numpy(arrays["torch"]))
    if "torch_cuda" in arrays and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(arrays["torch_cuda"]))
    algorithm, position, has_gauss, cached_gauss = details["numpy"]
    np.random.set_state((algorithm, arrays["numpy_keys"], position, has_gauss, cached_gauss))
    python_version, python_gauss = details["python"]
    random.setstate((python_version, tuple(int(value) for value in arrays["python_state"]), python_gauss))
