"""Peak memory of a process (GPU allocated and reserved, or CPU resident), gathered from every rank."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: GPU memory allocated by torch, or CPU resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak_kib / (2**30 if sys.platform == "darwin" else 2**20)


def peak_reserved_gib(device: torch.device) -> float | None:
    """Peak GPU memory torch's caching allocator held (allocated plus its cache; above peak_memory_gib by
    what fragmentation costs); None off the GPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def gather_floats(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """One float from every rank, in rank order (a collective over `group`: every rank must call it). On a gloo
    group with device cpu nothing waits for the GPU."""
    local = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.cat(gathered).tolist()
