"""--optimizer_in_backward (training/in_backward.py): each unit stepped inside backward gives the weights of the
ordinary step bit for bit (one microbatch, no clipping), with one process as a plain module and as FSDP2 (2
processes: tests/distributed/test_in_backward_distributed.py); gradients are freed unit by unit; what it
cannot do is refused in one line naming the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from torch.distributed.tensor import DTensor
from unet_batches import make_train_step, synthetic_batch

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.fsdp import gradient_units, prepare_unet, shard_unet
from sdxl_trainer.optimizers.build import IN_BACKWARD_REFUSED, OPTIMIZERS, build_optimizer
from sdxl_trainer.training.ema import ShardedEMA

IN_BACKWARD_OPTIMIZERS = [name for name in OPTIMIZERS if name not in IN_BACKWARD_REFUSED]
UPDATES = 3


def unet_in_layout(layout: str, pipeline_dir, world) -> UNet2DConditionModel:
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    if layout == "fsdp2":
        shard_unet(unet, world.mesh, param_dtype=None)
    else:
        prepare_unet(unet, world, None)
    return unet


def weights(unet) -> dict[str, torch.Tensor]:
    return {name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()).clone() for name, parameter in unet.named_parameters()}


class GradientBytes:
    """The most gradient bytes the parameters held at once, seen after each gradient is accumulated (these hooks
    are registered after the optimizer in backward's, so they see what it left)."""

    def __init__(self, parameters: list[torch.nn.Parameter]):
        self.parameters, self.peak = parameters, 0
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self.seen)

    def seen(self, _parameter) -> None:
        held = sum(parameter.grad.numel() * parameter.grad.element_size() for parameter in self.parameters if parameter.grad is not None)
        self.peak = max(self.peak, held)


def train(name: str, layout: str, pipeline_dir, world, in_backward: bool, use_ema: bool = False) -> tuple[dict, list, int, object]:
    torch.manual_seed(0)
    unet = unet_in_layout(layout, pipeline_dir, world)
    optimizer = build_optimizer(name, unet.parameters(), 1e-3 if name != "lion" else 1e-4, 1e-2, (0.9, None), 1e-8)
    ema = ShardedEMA(unet, decay=0.9, on_cpu=False) if use_ema else None
    step = make_train_step(unet, optimizer, pipeline_dir, max_grad_norm=0.0, ema=ema, optimizer_in_backward=in_backward)
    gradient_bytes = GradientBytes(list(unet.parameters()))
    results = []
    for update in range(UPDATES):
        results.append(step([synthetic_batch(unet, [2 * update, 2 * update + 1], seed=update, height=16, width=16)], epoch=0))
        assert all(parameter.grad is None for parameter in unet.parameters())
    return weights(unet), results, gradient_bytes.peak, ema


@pytest.mark.parametrize("layout", ["plain", "fsdp2"])
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "adamw8bit" else name for name in IN_BACKWARD_OPTIMIZERS])
def test_in_backward_gives_the_ordinary_steps_weights_bit_for_bit(world, tiny_pipeline_dir, name, layout):
    ordinary, ordinary_results, ordinary_peak, ordinary_ema = train(name, layout, tiny_pipeline_dir, world, in_backward=False, use_ema=True)
    stepped, results, peak, ema = train(name, layout, tiny_pipeline_dir, world, in_backward=True, use_ema=True)
    start = weights(unet_in_layout(layout, tiny_pipeline_dir, world))
    assert any(not torch.equal(start[key], ordinary[key]) for key in start)  # the weights moved
    assert all(torch.equal(ordinary[key], stepped[key]) for key in ordinary), name
    assert all(torch.equal(a, b) for a, b in zip(ordinary_ema.shadow, ema.shadow))
    for a, b in zip(ordinary_results, results):
        assert a.loss == b.loss and b.stepped and a.learning_rate == b.learning_rate
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)  # summed unit by unit
    # The ordinary step holds every gradient at the end of backward; in backward each unit's are freed once stepped.
    total = sum(parameter.numel() * parameter.element_size() for parameter in start.values())
    assert ordinary_peak == total
    assert peak < total / 2, (peak, total)


def test_units_partition_the_unet_as_fsdp2_does(world, tiny_pipeline_dir):
    """One process's plain UNet is stepped by the units FSDP2 would make of it."""
    plain = unet_in_layout("plain", tiny_pipeline_dir, world)
    sharded = unet_in_layout("fsdp2", tiny_pipeline_dir, world)

    def names(unet) -> list[list[str]]:
        name_of = {parameter: name for name, parameter in unet.named_parameters()}
        return sorted(sorted(name_of[parameter] for parameter in unit) for unit in gradient_units(unet))

    assert names(plain) == names(sharded)
    assert len(names(plain)) > 5


def test_a_nonfinite_loss_skips_every_unit(world, tiny_pipeline_dir):
    unet = unet_in_layout("fsdp2", tiny_pipeline_dir, world)
    optimizer = build_optimizer("adamw", unet.parameters(), 1e-3, 1e-2, (0.9, None), 1e-8)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir, max_grad_norm=0.0, optimizer_in_backward=True)
    assert step([synthetic_batch(unet, [0, 1], seed=3, height=16, width=16)], epoch=0).stepped
    before = weights(unet)
    state_before = [value.clone() for state in optimizer.state.values() for value in state.values()]
    poisoned = synthetic_batch(unet, [0, 1], seed=4, height=16, width=16)
    poisoned["latents"][1, 0, 0, 0] = float("nan")
    result = step([poisoned], epoch=0)
    assert not result.stepped and np.isnan(result.loss) and result.skipped_updates == 1
    assert all(torch.equal(before[key], value) for key, value in weights(unet).items())
    state_after = [value for state in optimizer.state.values() for value in state.values()]
    assert all(torch.equal(a, b) for a, b in zip(state_before, state_after))
    assert all(parameter.grad is None for parameter in unet.parameters())
    assert step([synthetic_batch(unet, [0, 1], seed=4, height=16, width=16)], epoch=0).stepped


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "--optimizer_in_backward steps each unit as soon as its gradients are final, before the global gradient norm exists, so it "
             "cannot clip by that norm: pass --max_grad_norm 0"),
        (["--max_grad_norm", "0", "--gradient_accumulation_steps", "2"],
         "--optimizer_in_backward steps in each microbatch's backward and cannot accumulate gradients: pass --gradient_accumulation_steps 1"),
        (["--max_grad_norm", "0", "--mixed_precision", "fp16"], "--optimizer_in_backward cannot take fp16's loss scaling"),
        (["--max_grad_norm", "0", "--optimizer", "prodigy", "--learning_rate", "1"],
         "--optimizer_in_backward cannot step --optimizer prodigy a unit at a time: its step size d comes from sums over every parameter"),
        (["--max_grad_norm", "0", "--optimizer", "adamw_schedulefree", "--learning_rate_scheduler", "constant"],
         "--optimizer_in_backward cannot step --optimizer adamw_schedulefree a unit at a time: its averaging scalars"),
    ],
)  # fmt: skip
def test_what_in_backward_cannot_do_is_refused_in_one_line(flags, message, capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer_in_backward", *flags])
    errors = capsys.readouterr().err
    assert message in errors
    assert sum("--optimizer_in_backward" in line for line in errors.splitlines()) == 1


def test_in_backward_with_its_settings_is_accepted():
    from sdxl_trainer.jobs.train_config import TrainConfig

    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer_in_backward", "--max_grad_norm", "0"])
    assert config.optimizer_in_backward and config.gradient_accumulation_steps == 1
