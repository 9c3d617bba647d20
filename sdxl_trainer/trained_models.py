"""The modules a run trains, under the pipeline's component names: the UNet, and with --train_text_encoder
both text encoders. One object for what is checkpointed, exported and handed to sampling, so those three
always agree on which weights were trained.
"""

from __future__ import annotations

import torch
from torch import nn

from .ema import ShardedEMA
from .lr_schedule import LR_SCALE
from .parallel import full_state_dict_on_rank0

TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2")  # the pipeline's attribute names

ComponentWeights = dict[str, dict[str, torch.Tensor]]  # pipeline component name -> its full state dict


class TrainedModels(nn.Module):
    def __init__(self, unet: nn.Module, text_encoders: tuple[nn.Module, nn.Module] | None = None):
        super().__init__()
        self.unet = unet
        for name, encoder in zip(TEXT_ENCODER_NAMES, text_encoders or ()):
            self.add_module(name, encoder)

    @property
    def trains_text_encoders(self) -> bool:
        return len(self._modules) > 1

    @property
    def checkpointed(self) -> nn.Module:
        """The module whose weights and optimizer state a checkpoint holds: the UNet alone when only it trains
        (its parameter names are the checkpoint's, as in every UNet-only checkpoint), else all of them
        (names prefixed "unet.", "text_encoder.", "text_encoder_2.")."""
        return self if self.trains_text_encoders else self.unet

    def parameter_groups(self, learning_rate: float, text_encoder_rates: tuple[float, float]) -> list[dict]:
        """Optimizer param groups: the UNet at learning_rate, each trained text encoder (its parameters that
        require gradients) at its own rate. The rates are peaks: the schedule scales every group alike
        (lr_schedule.LR_SCALE)."""
        groups = [{"params": list(self.unet.parameters()), "lr": learning_rate}]
        for name, rate in zip(TEXT_ENCODER_NAMES, text_encoder_rates):
            if name in self._modules:
                trained = [parameter for parameter in self._modules[name].parameters() if parameter.requires_grad]
                groups.append({"params": trained, "lr": rate, LR_SCALE: rate / learning_rate})
        return groups

    def exported_weights_on_rank0(self, ema: ShardedEMA | None, is_main: bool) -> ComponentWeights:
        """Collective: the full weights that get exported and sampled from, per component, in rank 0's CPU
        memory ({} per component elsewhere). The UNet's are the EMA's when there is one (the EMA averages the
        UNet only); trained text encoders give their own weights."""
        weights = {"unet": ema.full_state_dict_on_rank0(is_main) if ema is not None else full_state_dict_on_rank0(self.unet)}
        for name, module in self.named_children():
            if name != "unet":
                weights[name] = full_state_dict_on_rank0(module)
        return weights
