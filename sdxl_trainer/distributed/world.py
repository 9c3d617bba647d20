"""The process group: set-up and tear-down, each rank's device and compile cache, and the small
collectives on text that the job's parts agree through.

Launch with `accelerate launch` or `torchrun` (they set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
a plain `python` run becomes a one-process group, so collectives (loss averaging, checkpoint agreement,
the watchdog) run the same everywhere.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a rendezvous on this machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_distributed(replicate_groups: int = 1) -> World:
    """Join (or create) the process group: nccl on CUDA, gloo on CPU; the mesh as device_mesh says."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world_size, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    use_rank_own_compile_cache(rank, world_size)
    use_expandable_segments()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None)
    return World(rank, world_size, local_rank, device, device_mesh(device.type, world_size, replicate_groups))


def device_mesh(device_type: str, world_size: int, replicate_groups: int = 1) -> DeviceMesh:
    """The processes' mesh: 1-D (full sharding over every GPU), or with `replicate_groups` > 1 a 2-D mesh of
    that many groups of consecutive ranks (a machine's GPUs under torchrun), on which FSDP2 shards each model
    within a group and replicates it across groups (HSDP): the parameters' all-gathers and the gradients'
    reduce-scatters stay inside a group, over NVLink, and only the all-reduce of each gradient shard between
    the groups' matching ranks crosses the network."""
    if replicate_groups < 1 or world_size % replicate_groups:
        raise SystemExit(
            f"--replicate_groups {replicate_groups} does not divide the {world_size} processes into equal groups: give the number "
            "of machines (or another divisor of the process count), or 1 for full sharding"
        )
    if replicate_groups == 1:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(device_type, (replicate_groups, world_size // replicate_groups), mesh_dim_names=("replicate", "shard"))


def use_rank_own_compile_cache(rank: int, world_size: int) -> None:
    """Give each rank its own torch.compile (inductor) cache folder.

    The cache key of a graph over DTensors holds the global shape but not the rank's local one, so with
    an uneven shard (33 rows on 2 ranks: 17 and 16) a rank can load the kernel another rank compiled and
    fail with "expected size 17==16" (seen with torchao's compiled AdamW8bit step; the same family as
    pytorch issues 188332 and 188390). Keyed by world size too, as it changes every shard's shape.
    The folders sit in the virtual env (not /tmp, which a reboot empties), so compiled kernels (torchao's
    8-bit AdamW step: minutes on a CPU) are reused by every later run."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None or Path(base) == Path(default_cache_dir()).absolute():
        # Importing torch._dynamo (diffusers and torchao do) fills the variable with inductor's default in /tmp
        # when it is unset, so by now that value means "not chosen by the user".
        base = compile_cache_root()
    own = f"rank{rank}_of_{world_size}"
    if Path(base).name != own:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(base) / own)


def use_expandable_segments() -> None:
    """Let CUDA's caching allocator grow its segments in place (before the first allocation reads the setting),
    unless PYTORCH_CUDA_ALLOC_CONF is set already. Bucket shapes change from step to step, and with fixed
    segments the freed blocks of one shape fit the next one badly: reserved memory creeps above what is
    allocated until a step runs out. Expandable segments are PyTorch's remedy for such fragmentation."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def compile_cache_root() -> Path:
    """Where compiled kernels are kept across runs: inside the virtual env when there is one."""
    in_venv = sys.prefix != sys.base_prefix
    return Path(sys.prefix) / "compile_cache" if in_venv else Path(default_cache_dir())


def broadcast_text(text: str, device: torch.device, src: int = 0) -> str:
    """Collective: rank `src`'s text on every rank (as bytes in tensors: no pickling)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if dist.get_rank() != src:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return bytes(data.cpu().tolist()).decode()


def all_gather_text(text: str, device: torch.device, group: dist.ProcessGroup | None = None) -> list[str]:
    """Collective over `group` (default: every process): every rank's text, in rank order, on every rank (as
    bytes in tensors: no pickling)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    sizes = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(*sizes, 1), dtype=torch.uint8, device=device)
    padded[: len(data)] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(chunk[:size].cpu().tolist()).decode() for chunk, size in zip(gathered, sizes)]


def all_gather_floats(values: list[float], group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """Collective over `group` (a gloo group: CPU tensors): every rank's `values`, in rank order. One exchange
    however many values, and the host never waits for a GPU."""
    local = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).tolist()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor for a collective over `group` must live: the GPU under nccl, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_ranks_succeeded(succeeded: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Collective over `group`: True on every rank when every rank passed True."""
    flag = torch.tensor([1 if succeeded else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
