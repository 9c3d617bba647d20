"""The modules a run trains, under the pipeline's component names: the UNet, and with --train_text_encoder
the text encoders whose learning rate is not 0. One object for what is checkpointed, exported and handed
to sampling, so those three always agree on which weights were trained.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from sdxl_trainer.distributed.fsdp import full_state_dict_on_rank0, reshard_units
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.models.components import TEXT_ENCODER_NAMES, ComponentWeights
from sdxl_trainer.optimizers.shards import runs_of_at_most
from sdxl_trainer.training.block_rates import unet_blocks
from sdxl_trainer.training.ema import EVALUATION_RUN_VALUES, ShardedEMA
from sdxl_trainer.training.lr_schedule import LR_SCALE


class TrainedModels(nn.Module):
    def __init__(self, unet: nn.Module, text_encoders: dict[str, nn.Module] | None = None):
        """text_encoders: the trained ones by pipeline name (TEXT_ENCODER_NAMES); frozen ones stay out."""
        super().__init__()
        self.unet = unet
        for name in TEXT_ENCODER_NAMES:
            if name in (text_encoders or {}):
                self.add_module(name, text_encoders[name])
        self.evaluation_weights: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None  # evaluate_with

    def evaluate_with(self, evaluation_weights: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None) -> None:
        """Where the optimizer trains other weights than those to evaluate and export (schedule-free AdamW:
        optimizers/build.evaluation_weights_of), how to get those: validation, samples and exports then use
        them (evaluation_weights_in_model). None: the trained weights themselves."""
        self.evaluation_weights = evaluation_weights

    @contextlib.contextmanager
    def evaluation_weights_in_model(self) -> Iterator[None]:
        """The weights to evaluate and export in the trained parameters for the block (evaluate_with; nothing to
        do without); the trained weights come back afterwards, bit for bit, so training and its checkpoints go on
        from them. Not collective: each rank swaps its own shards, a run of tensors at a time. Costs one more
        copy of this rank's trained shards while it lasts. FSDP2 units still gathered after a forward without
        backward are resharded at both ends, so no gathered copy outlives the swap (as the EMA's swap)."""
        if self.evaluation_weights is None:
            yield
            return
        parameters = [parameter for parameter in self.parameters() if parameter.requires_grad]
        shards = [local_shard(parameter) for parameter in parameters]
        reshard_units(self)
        with torch.no_grad():
            trained = [shard.detach().clone() for shard in shards]
            for run in runs_of_at_most(list(range(len(parameters))), [shard.numel() for shard in shards], EVALUATION_RUN_VALUES):
                torch._foreach_copy_([shards[index] for index in run], self.evaluation_weights([parameters[index] for index in run]))
        try:
            yield
        finally:
            reshard_units(self)
            with torch.no_grad():
                torch._foreach_copy_(shards, trained)

    @property
    def trains_text_encoders(self) -> bool:
        return len(self._modules) > 1

    @property
    def checkpointed(self) -> nn.Module:
        """The module whose weights and optimizer state a checkpoint holds: the UNet alone when only it trains
        (its parameter names are the checkpoint's, as in every UNet-only checkpoint), else all of them
        (names prefixed "unet.", "text_encoder.", "text_encoder_2.": the trained ones)."""
        return self if self.trains_text_encoders else self.unet

    def parameter_groups(self, learning_rate: float, text_encoder_rates: dict[str, float], block_rates: list[float] | None = None) -> list[dict]:
        """Optimizer param groups: the UNet at learning_rate, or each of its blocks at its rate in `block_rates`
        (--block_lr, block_rates.py; a block at 0 is left out), then each trained text encoder (its parameters
        that require gradients) at its own rate (by pipeline name). The rates are peaks: the schedule scales
        every group alike (lr_schedule.LR_SCALE)."""
        if block_rates is None:
            groups = [{"params": list(self.unet.parameters()), "lr": learning_rate}]
        else:
            groups = [
                {"params": parameters, "lr": rate, LR_SCALE: rate / learning_rate}
                for rate, parameters in zip(block_rates, unet_blocks(self.unet), strict=True)
                if rate != 0
            ]
        for name in TEXT_ENCODER_NAMES:
            if name in self._modules:
                trained = [parameter for parameter in self._modules[name].parameters() if parameter.requires_grad]
                rate = text_encoder_rates[name]
                groups.append({"params": trained, "lr": rate, LR_SCALE: rate / learning_rate})
        return groups

    def exported_weights_on_rank0(self, ema: ShardedEMA | None, is_main: bool) -> ComponentWeights:
        """Collective: the full weights that get exported and sampled from, per component, in rank 0's CPU
        memory ({} per component elsewhere). The UNet's are the EMA's when there is one (the EMA averages the
        UNet only); trained text encoders give their own weights; both are the evaluation weights of an
        optimizer that keeps them apart (evaluate_with)."""
        with self.evaluation_weights_in_model():
            weights = {"unet": ema.full_state_dict_on_rank0(is_main) if ema is not None else full_state_dict_on_rank0(self.unet)}
            for name, module in self.named_children():
                if name != "unet":
                    weights[name] = full_state_dict_on_rank0(module)
            if self.evaluation_weights is not None:
                # Gathered on one CPU process, a tensor can be the parameter's own storage, which the swap's end
                # sets back to the trained weights: copies, made before it.
                weights = {component: {name: tensor.clone() for name, tensor in state.items()} for component, state in weights.items()}
        return weights
