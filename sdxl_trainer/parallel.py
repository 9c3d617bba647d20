"""Process group set-up and every FSDP2 decision about the UNet, in one place.

Launch with `accelerate launch` or `torchrun` (they set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
a plain `python` run becomes a one-process group, so collectives (loss averaging, checkpoint agreement,
the watchdog) run the same everywhere. The UNet is sharded with FSDP2 only where that buys something
(prepare_unet): one process trains a plain module.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


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


def all_gather_text(text: str, device: torch.device) -> list[str]:
    """Collective: every rank's text, in rank order, on every rank (as bytes in tensors: no pickling)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device))
    sizes = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(*sizes, 1), dtype=torch.uint8, device=device)
    padded[: len(data)] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [bytes(chunk[:size].cpu().tolist()).decode() for chunk, size in zip(gathered, sizes)]


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def uses_sharding(world_size: int, cpu_offload: bool) -> bool:
    """FSDP2 only where it buys something: more than one process to shard over, or CPU offload (FSDP2's
    policy). On one process it saves no memory, and its DTensor parameters and per-block copies made an
    update of the tiny UNet on CPU 1.25x as long as a plain module's (benchmarks/bench_trainer.py)."""
    return world_size > 1 or cpu_offload


def prepare_unet(
    unet: nn.Module,
    world: World,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    compile_blocks: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """The UNet ready to train in this world, in place: FSDP2-sharded (shard_unet) where uses_sharding says
    so, otherwise a plain module whose forward runs under torch.autocast in param_dtype (compute_under_autocast).
    Both keep the weights and gradients in the dtype the UNet arrives in (fp32 master weights, or bf16 with
    --weights_dtype bf16) and the same parameter names, so checkpoints move between the two (DCP reshards)
    and the export is the same."""
    if uses_sharding(world.world_size, cpu_offload):
        return shard_unet(unet, world.mesh, param_dtype, reshard_after_forward, compile_blocks, cpu_offload)
    if compile_blocks:
        compile_repeated_blocks(unet)
    if param_dtype is not None:
        compute_under_autocast(unet, world.device.type, param_dtype)
    return unet


def compile_repeated_blocks(unet: nn.Module) -> None:
    """Regional torch.compile of each transformer block and each ResNet block (as torchtitan does): the
    blocks repeat, so each kind compiles once per shape, and FSDP's hooks stay outside the compiled graphs.

    Dynamo keeps at most `recompile_limit` graphs per forward function (8 by default) and runs every shape past
    that eagerly, with a warning. SDXL's ResNet blocks come in 12 parameter shapes, each compiled once with
    static sizes and once more with dynamic sizes when a second bucket arrives, so the limit is raised to that
    count (on an H200 the update was already 1.8x faster with 8 of the 12 compiled than with none)."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    shapes_per_kind: dict[type, set[tuple]] = {}
    for module in unet.modules():
        if isinstance(module, (BasicTransformerBlock, ResnetBlock2D)):
            module.compile()
            shapes = tuple(tuple(parameter.shape) for parameter in module.parameters())
            shapes_per_kind.setdefault(type(module), set()).add(shapes)
    graphs_per_forward = 2 * max((len(shapes) for shapes in shapes_per_kind.values()), default=0)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs_per_forward)


def compute_under_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Mixed precision for an unsharded module: its forward runs under torch.autocast(dtype) over fp32
    weights, entered by a forward pre-hook and left by a forward hook that also runs when forward raises.
    Gradient checkpointing's recomputation re-enters the same autocast state. The weight-cast cache is off:
    each weight is cast when used and the copy freed with its block (with gradient checkpointing a cache
    would hold a second, bf16 copy of the whole UNet, 5.1 GB for SDXL, through the forward).
    Autocast keeps normalisations and softmax in fp32, where FSDP2's param_dtype runs everything in bf16."""
    open_contexts: list[torch.autocast] = []

    def enter(_module: nn.Module, _args: tuple) -> None:
        context = torch.autocast(device_type, dtype=dtype, cache_enabled=False)
        context.__enter__()
        open_contexts.append(context)

    def leave(_module: nn.Module, _args: tuple, _output: object) -> None:
        open_contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def shard_unet(
    unet: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    compile_blocks: bool = False,
    cpu_offload: bool = False,
) -> FSDPModule:
    """Apply FSDP2 to the UNet in place; parameters keep their dtype (the sharded master copy: fp32, or bf16).

    - Granularity: each transformer block, then each down/mid/up block, then the root. A transformer
      block is SDXL's unit of memory (the 10-block stages hold most of the 2.6 B parameters); sharding
      it on its own means only one block's full weights are gathered at a time, and its all-gather
      overlaps the previous block's compute.
    - reshard_after_forward=True is FULL_SHARD (weights gathered again for backward, least memory);
      False keeps them gathered between forward and backward (SHARD_GRAD_OP: faster, more memory).
    - Precision: compute in param_dtype (bf16/fp16) with fp32 gradient reduction, over fp32 shards (or bf16
      ones, whose gradients FSDP2 reduces in fp32 and stores in bf16). No autocast in the loop. The frozen VAE never reaches here (training reads the cache); text encoders
      only when trained (prepare_text_encoder).
    - cpu_offload: FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and so the optimizer
      state live in CPU memory; each block's weights are copied to the GPU for its forward and backward, and
      the optimizer steps on the CPU. A GPU then holds activations and a block or two of gathered weights.
    - compile_blocks: compile_repeated_blocks before sharding; other bucket shapes recompile with dynamic sizes.
    """
    kwargs = _fsdp_settings(mesh, param_dtype, reshard_after_forward, cpu_offload)
    from diffusers.models.attention import BasicTransformerBlock

    if compile_blocks:
        compile_repeated_blocks(unet)
    for module in unet.modules():
        if isinstance(module, BasicTransformerBlock):
            fully_shard(module, **kwargs)
    for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        fully_shard(block, **kwargs)
    fully_shard(unet, **kwargs)
    return unet  # type: ignore[return-value]


def _fsdp_settings(mesh: DeviceMesh, param_dtype: torch.dtype | None, reshard_after_forward: bool, cpu_offload: bool) -> dict:
    """fully_shard's arguments, the same for every trained module: compute in param_dtype, gradients reduced
    in fp32, optionally FSDP2's CPU offload."""
    settings = dict(
        mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32), reshard_after_forward=reshard_after_forward
    )
    if cpu_offload:
        settings["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    return settings


def prepare_text_encoder(encoder: nn.Module, world: World, param_dtype: torch.dtype | None, reshard_after_forward: bool = True,
                         cpu_offload: bool = False) -> nn.Module:
    """A trained text encoder (--train_text_encoder) ready in this world, in place, by prepare_unet's rule:
    where uses_sharding says so, FSDP2 over its embeddings, each CLIP layer, then each remaining module with
    parameters of its own (final norm, projection), with the UNet's precision and offload settings;
    otherwise plain under autocast.

    The transformers model itself is never wrapped: fully_shard changes a module's class, and transformers
    finds what output_hidden_states records by the model's class, so a wrapped CLIP returns no hidden states."""
    if not uses_sharding(world.world_size, cpu_offload):
        if param_dtype is not None:
            compute_under_autocast(encoder, world.device.type, param_dtype)
        return encoder
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer, CLIPTextEmbeddings

    settings = _fsdp_settings(world.mesh, param_dtype, reshard_after_forward, cpu_offload)
    for part in [module for module in encoder.modules() if isinstance(module, (CLIPTextEmbeddings, CLIPEncoderLayer))]:
        fully_shard(part, **settings)
    for part in [module for module in encoder.modules() if any(not isinstance(weight, DTensor) for weight in module.parameters(recurse=False))]:
        fully_shard(part, **settings)
    return encoder


def full_state_dict_on_rank0(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict into CPU memory of rank 0; other ranks get {}.

    Tensors are gathered one at a time and moved to CPU, so no GPU ever holds a second full copy."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank actually stores (its shards)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total
