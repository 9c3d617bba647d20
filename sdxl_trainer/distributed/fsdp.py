"""Every FSDP2 decision about the trained models, in one place: whether to shard, how (per block, mixed
precision, offload, HSDP), regional compilation, and the full weights gathered for export.

The UNet is sharded with FSDP2 only where that buys something (prepare_unet): one process trains a
plain module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, CheckpointImpl, CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sdxl_trainer.config import option
from sdxl_trainer.distributed.world import World
from sdxl_trainer.distributed.local_shard import local_shard


@dataclass(kw_only=True)
class ComputeOptions:
    """Precision, memory and sharding"""

    mixed_precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", help="UNet compute precision over fp32 master weights (FSDP2's param dtype; torch.autocast on one process): auto = bf16 where the GPU supports it, else fp16; fp32 on CPU (bf16 is emulated there, several times slower)"
    )
    weights_dtype: Literal["fp32", "bf16"] = option(
        "fp32",
        help="dtype of the trained weights and their gradients: fp32 (master weights; compute in --mixed_precision) or bf16 "
        "(half the memory of weights and gradients, compute in bf16, gradients accumulated in bf16; every optimizer computes in "
        "fp32 and rounds the new weights stochastically, so updates below bf16's resolution still land on average; kohya's --full_bf16)",
    )
    gradient_checkpointing: bool = option(
        True, help="recompute activations in backward (the UNet's, and trained text encoders'): much less memory, about 30%% more compute"
    )
    cpu_offload: bool = option(
        False,
        help="keep the sharded weights, gradients and optimizer state in CPU memory (FSDP2 CPU offload): one 24 GB GPU "
        "can then train the full UNet, at the cost of host-device copies and an optimizer step on the CPU",
    )
    reshard_after_forward: bool = option(True, help="FSDP FULL_SHARD (True, least memory) or SHARD_GRAD_OP (False, faster, more memory); unused where the UNet is not sharded")
    replicate_groups: int = option(
        1,
        help="HSDP: split the processes into this many groups of consecutive ranks (give the number of machines); models are sharded "
        "within a group and replicated across groups, so weights are all-gathered over each machine's NVLink instead of the network. "
        "Each GPU then holds 1/(GPUs per group) of the weights and optimizer state instead of 1/(all GPUs); 1 = shard over every GPU",
    )
    reduce_dtype: Literal["fp32", "bf16"] = option(
        "fp32",
        help="dtype FSDP2 reduce-scatters the gradients in (and HSDP all-reduces them): fp32, or bf16, half the bytes, for GPUs linked by "
        "PCIe where the link is the bottleneck (the sum of a few shards' gradients loses little: docs/speed.md); unused where the UNet is not sharded",
    )
    compile_unet: bool = option(False, help="torch.compile each transformer and ResNet block (regional): faster steps after a compile of minutes")
    allow_tf32: bool = option(True, help="TF32 matmuls and convolutions for fp32 work on Ampere and newer GPUs")

    def problems(self) -> list[str]:
        problems = []
        if self.weights_dtype == "bf16" and self.mixed_precision in ("fp16", "fp32"):
            problems.append(f"--weights_dtype bf16 computes in bf16: drop --mixed_precision {self.mixed_precision} (or pass bf16), or keep fp32 weights")
        if self.replicate_groups < 1:
            problems.append("--replicate_groups must be >= 1 (1 = shard over every GPU)")
        return problems


def uses_sharding(world_size: int, cpu_offload: bool) -> bool:
    """FSDP2 only where it buys something: more than one process to shard over, or CPU offload (FSDP2's
    policy). On one process it saves no memory, and its DTensor parameters and per-block copies made an
    update of the tiny UNet on CPU longer than a plain module's (docs/design.md §1)."""
    return world_size > 1 or cpu_offload


def prepare_unet(
    unet: nn.Module,
    world: World,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    compile_blocks: bool = False,
    cpu_offload: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The UNet ready to train in this world, in place: FSDP2-sharded (shard_unet) where uses_sharding says
    so, otherwise a plain module whose forward runs under torch.autocast in param_dtype (compute_under_autocast).
    Both keep the weights and gradients in the dtype the UNet arrives in (fp32 master weights, or bf16 with
    --weights_dtype bf16) and the same parameter names, so checkpoints move between the two (DCP reshards)
    and the export is the same."""
    if uses_sharding(world.world_size, cpu_offload):
        return shard_unet(unet, world.mesh, param_dtype, reshard_after_forward, compile_blocks, cpu_offload, reduce_dtype)
    if compile_blocks:
        compile_repeated_blocks(unet)
    if param_dtype is not None:
        compute_under_autocast(unet, world.device.type, param_dtype)
    return unet


def compile_repeated_blocks(unet: nn.Module) -> None:
    """Regional torch.compile of each transformer block and each ResNet block (as torchtitan does): the blocks
    repeat, so each kind compiles once per shape, and FSDP's hooks stay outside the compiled graphs.

    With gradient checkpointing, the checkpoint moves inside the compiled region: each block is wrapped in a
    non-reentrant checkpoint and the wrapper is compiled, so the recomputation is part of the compiled backward
    graph. Left outside (diffusers' checkpointing around compiled blocks), backward recomputes each block through
    Dynamo again; on a GPU that runs on the autograd engine's device thread, whose thread count and per-thread
    Dynamo settings differ from the forward's, so every recomputation missed the forward's graphs and compiled
    anew until the recompile limit ran out, then ran eagerly what the forward ran compiled, and checkpointing
    refused the different tensors (the crash on an H200, tests/training/test_compile.py). Parameter and state-dict names
    keep the wrapper out (parameter_names; DCP and state_dict drop its prefix).

    Dynamo keeps at most `recompile_limit` graphs per forward function and runs every shape past that eagerly.
    Blocks of one class share their forward's code, and so its limit; each parameter shape compiles once with
    static sizes and once more with dynamic sizes when a second bucket arrives. The limit is given to each
    compile (Dynamo's global setting is per thread): SDXL needs 24 for its 12 ResNet shapes, 28 for all 14
    block shapes behind the one checkpoint wrapper (recompile_limit_for)."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    checkpointed = getattr(unet, "is_gradient_checkpointing", False)
    if checkpointed:
        unet.disable_gradient_checkpointing()  # the checkpoint goes inside each compiled block instead
    compiled = []
    for parent in list(unet.modules()):
        for name, block in list(parent.named_children()):
            if isinstance(block, (BasicTransformerBlock, ResnetBlock2D)):
                if checkpointed:
                    block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                    setattr(parent, name, block)
                compiled.append(block)
    limit = recompile_limit_for(compiled)
    for block in compiled:
        block.compile(recompile_limit=limit)


def recompile_limit_for(blocks: list[nn.Module]) -> int:
    """Graphs Dynamo keeps per forward function for `blocks`: a static and a dynamic-size graph for every
    parameter shape among the blocks that share a forward (a class: blocks of one class, or every checkpoint
    wrapper), the largest such count over the classes."""
    shapes_per_forward: dict[type, set[tuple]] = {}
    for block in blocks:
        shapes_per_forward.setdefault(type(block), set()).add(tuple(tuple(parameter.shape) for parameter in block.parameters()))
    return 2 * max((len(shapes) for shapes in shapes_per_forward.values()), default=0)


def parameter_names(model: nn.Module) -> list[str]:
    """The model's parameter names as its state dict and checkpoints name them: without the prefix of the
    checkpoint wrappers compile_repeated_blocks adds (named_parameters keeps it)."""
    return [name.replace(_CHECKPOINT_PREFIX, "") for name, _ in model.named_parameters()]


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
    reduce_dtype: torch.dtype = torch.float32,
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
    - compile_blocks: compile_repeated_blocks before sharding (torchtitan's order: checkpointing, compile,
      FSDP), so a checkpoint-wrapped transformer block is sharded as its wrapper; other bucket shapes recompile
      with dynamic sizes.
    """
    kwargs = _fsdp_settings(mesh, param_dtype, reshard_after_forward, cpu_offload, reduce_dtype)
    if compile_blocks:
        compile_repeated_blocks(unet)
    for module in _transformer_blocks(unet):
        fully_shard(module, **kwargs)
    stages = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]  # as the UNet's forward runs them
    for block in stages:
        fully_shard(block, **kwargs)
    # The root stays gathered from its forward to its backward, which begins with it (FSDP2's own choice for a
    # root; an explicit True would make it reshard and gather again).
    fully_shard(unet, **{**kwargs, "reshard_after_forward": False})
    prefetch_in_order(unet, stages)
    return unet  # type: ignore[return-value]


def _transformer_blocks(unet: nn.Module) -> list[nn.Module]:
    """The UNet's transformer blocks, each as itself or as the checkpoint wrapper around it (compile_repeated_blocks)."""
    from diffusers.models.attention import BasicTransformerBlock

    inside_wrappers = {id(module._checkpoint_wrapped_module) for module in unet.modules() if isinstance(module, CheckpointWrapper)}
    blocks = []
    for module in unet.modules():
        block = module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module
        if isinstance(block, BasicTransformerBlock) and id(module) not in inside_wrappers:
            blocks.append(module)
    return blocks


def gradient_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """The model's parameters by unit, each unit's own (not those of the units inside it): a sharded model's
    FSDP2 modules, whose gradients one reduce-scatter makes final together; a plain module (one process) by
    the units sharding would make of it: for a UNet shard_unet's (transformer blocks, down/mid/up blocks, the
    root), for a text encoder its embeddings and each CLIP layer, the rest together. The optimizer in backward
    steps a unit at a time (training/in_backward.py)."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not units:
        from diffusers import UNet2DConditionModel

        if isinstance(model, UNet2DConditionModel):
            units = [*_transformer_blocks(model), *model.down_blocks, model.mid_block, *model.up_blocks]
        else:
            from transformers.models.clip.modeling_clip import CLIPEncoderLayer, CLIPTextEmbeddings

            units = [module for module in model.modules() if isinstance(module, (CLIPTextEmbeddings, CLIPEncoderLayer))]
    order = {id(module): number for number, module in enumerate(model.modules())}
    # model.modules() lists a module before those inside it: the last unit to claim a parameter is its innermost.
    owner: dict[nn.Parameter, int] = {}
    for module in [model, *sorted(units, key=lambda unit: order[id(unit)])]:
        for parameter in module.parameters():
            owner[parameter] = order[id(module)]
    by_unit: dict[int, list[nn.Parameter]] = {}
    for parameter, unit in owner.items():
        by_unit.setdefault(unit, []).append(parameter)
    return [by_unit[unit] for unit in sorted(by_unit)]


def reshard_units(model: nn.Module) -> None:
    """Every FSDP2 unit of the model back to its shards (not collective). A unit kept gathered after its forward
    (the root; every unit with --no-reshard_after_forward) is resharded by its backward, so after a forward
    without one (validation) it would stay gathered, and its gathered copy would go stale once its shards
    change (the EMA's weights swapped in or out, the next optimizer step): the next forward would use it."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def prefetch_in_order(root: FSDPModule, stages: list[nn.Module]) -> None:
    """An explicit forward prefetch chain over the model's FSDP2 units: each unit's pre-forward starts the next
    unit's all-gather, so a gather never waits for the host to reach the unit that needs it (FSDP2 issues it
    only when the host gets there otherwise: a host that falls behind leaves the GPU waiting). `stages`: the
    root's units in the order its forward runs them (the UNet registers its up blocks before its mid block but
    runs them after), each running the units inside it in the order they were registered; a chain out of
    order costs a gather, as a unit prefetched after it ran is gathered again.
    Backward keeps FSDP2's own prefetch, which follows the order the forwards ended in and runs once per unit:
    an explicit backward list runs at each of a unit's output gradients, and a down block's skip connections
    reach it several times, so a prefetch after the unit's backward gathered it again (one transformer block
    per down block per microbatch, counted in tests/estimates/test_speed_estimate.py)."""
    forward: list[nn.Module] = [root]
    for stage in stages:
        forward += [stage, *(module for module in stage.modules() if isinstance(module, FSDPModule) and module is not stage)]
    for unit, following in zip(forward, forward[1:]):
        unit.set_modules_to_forward_prefetch([following])


def _fsdp_settings(mesh: DeviceMesh, param_dtype: torch.dtype | None, reshard_after_forward: bool, cpu_offload: bool,
                   reduce_dtype: torch.dtype = torch.float32) -> dict:
    """fully_shard's arguments, the same for every trained module: compute in param_dtype, gradients reduced
    in reduce_dtype (fp32, or bf16: --reduce_dtype), optionally FSDP2's CPU offload."""
    settings = dict(
        mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype), reshard_after_forward=reshard_after_forward
    )
    if cpu_offload:
        settings["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    return settings


def prepare_text_encoder(encoder: nn.Module, world: World, param_dtype: torch.dtype | None, reshard_after_forward: bool = True,
                         cpu_offload: bool = False, reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
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

    settings = _fsdp_settings(world.mesh, param_dtype, reshard_after_forward, cpu_offload, reduce_dtype)
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
        local = local_shard(parameter)
        total += local.numel() * local.element_size()
    return total
