"""Our Prodigy against prodigyopt (a test dependency only) on the same tensors and gradients: the weights and
its step-size estimate d; on DTensors as on plain tensors; each param group at its own rate; the flags that
refuse a rate left at AdamW's. (2 ranks against 1 process: tests/distributed/test_optimizer_shards.py; exact
resume, bf16 weights, skipped updates: the tests parametrized over every optimizer.)"""

from __future__ import annotations

import pytest
import torch
from prodigyopt import Prodigy as ReferenceProdigy

from sdxl_trainer.config import parse_config
from sdxl_trainer.optimizers.prodigy import D, D_MAX, NUMERATOR, SHARED, UPDATES, Prodigy, ProdigySettings

UPDATES_RUN = 12
SHAPES = [(24, 16), (24,), (6, 4, 3, 3)]


def start_and_target(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES], [torch.randn(shape, generator=generator) for shape in SHAPES]


def warm_up(update: int) -> float:
    """The rate of each update: 0 first (the trainer's warm-up starts there), up to 1 over 4 updates."""
    return min(1.0, update / 4)


def trained(optimizer_class, start: list[torch.Tensor], target: list[torch.Tensor], **settings) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """UPDATES_RUN updates on the quadratic loss |w - target|^2 (gradients that point one way for long, so d grows)."""
    parameters = [torch.nn.Parameter(weight.clone()) for weight in start]
    optimizer = optimizer_class(parameters, **settings)
    for update in range(UPDATES_RUN):
        for parameter, goal in zip(parameters, target):
            parameter.grad = 2 * (parameter.detach() - goal)
        for group in optimizer.param_groups:
            group["lr"] = warm_up(update)
        optimizer.step()
    return [parameter.detach() for parameter in parameters], optimizer


VARIANTS = {
    "defaults": {},
    "bias correction": {"use_bias_correction": True},
    "safeguarded warm-up": {"safeguard_warmup": True},
    "growth rate and d_coef": {"growth_rate": 1.5, "d_coef": 2.0},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_prodigy_gives_prodigyopts_weights_and_step_size(variant):
    settings = VARIANTS[variant]
    start, target = start_and_target()
    ours, optimizer = trained(Prodigy, start, target, lr=1.0, weight_decay=0.01, settings=ProdigySettings(**settings))
    theirs, reference = trained(ReferenceProdigy, start, target, lr=1.0, weight_decay=0.01, **settings)
    group = reference.param_groups[0]
    shared = optimizer.state[next(iter(optimizer.state))][SHARED]
    assert shared[D].item() > 10 * group["d0"]  # the estimate grew: its sums are what is compared
    assert shared[D].item() == pytest.approx(group["d"], rel=1e-5)
    assert shared[D_MAX].item() == pytest.approx(group["d_max"], rel=1e-5)
    assert shared[NUMERATOR].item() == pytest.approx(group["d_numerator"], rel=1e-5)
    assert shared[UPDATES].item() == group["k"] == UPDATES_RUN - 1  # the update at rate 0 is not counted
    assert all(state[SHARED] is shared for state in optimizer.state.values())  # one tensor for every parameter
    for our_weight, their_weight, first in zip(ours, theirs, start):
        moved = their_weight - first
        assert moved.abs().max() > 1e-5
        torch.testing.assert_close(our_weight - first, moved, rtol=1e-4, atol=1e-4 * moved.abs().max().item())  # to fp32 rounding


def test_dtensor_shards_step_as_plain_tensors(world):
    """On the 1-process mesh (FSDP2's layout on one rank) the local shards are the whole tensors: same values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    start, target = start_and_target(1)
    plain, _ = trained(Prodigy, start, target, lr=1.0, weight_decay=0.01)
    sharded = [distribute_tensor(weight, world.mesh, [Shard(0)]) for weight in start]
    sharded_targets = [distribute_tensor(goal, world.mesh, [Shard(0)]) for goal in target]
    weights, optimizer = trained(Prodigy, sharded, sharded_targets, lr=1.0, weight_decay=0.01)
    for weight, expected in zip(weights, plain):
        assert torch.equal(weight.full_tensor(), expected)
    assert all(state["p0"].placements == state["exp_avg"].placements == (Shard(0),) for state in optimizer.state.values())


@pytest.mark.parametrize("first_group_rate", [1.0, 0.0])
def test_param_groups_at_one_rate_or_at_0_give_prodigyopts_update(first_group_rate):
    """prodigyopt takes one rate for every group, or 0 for some (left as they are): the same here. (Groups at
    other rates step at d x their rate, which prodigyopt refuses.)"""
    start, target = start_and_target(2)


    def trained_in_groups(optimizer_class) -> list[torch.Tensor]:
        parameters = [torch.nn.Parameter(weight.clone()) for weight in start]
        optimizer = optimizer_class([{"params": parameters[:1], "lr": first_group_rate}, {"params": parameters[1:], "lr": 1.0}])
        for _ in range(UPDATES_RUN):
            for parameter, goal in zip(parameters, target):
                parameter.grad = 2 * (parameter.detach() - goal)
            optimizer.step()
        return [parameter.detach() for parameter in parameters]

    ours, theirs = trained_in_groups(Prodigy), trained_in_groups(ReferenceProdigy)
    for our_weight, their_weight in zip(ours, theirs):
        torch.testing.assert_close(our_weight, their_weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0], start[0]) == (first_group_rate == 0.0)
    assert not torch.equal(ours[1], start[1])


def test_prodigy_refuses_adamws_learning_rate_and_takes_its_own_settings():
    from sdxl_trainer.jobs.train_config import TrainConfig

    def config(*flags: str) -> TrainConfig:
        return parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", "prodigy", *flags])

    with pytest.raises(SystemExit):
        config()  # --learning_rate 1e-5, the default
    with pytest.raises(SystemExit):  # the text encoders' rates multiply d too
        config("--learning_rate", "1", "--encode_captions_each_step", "--train_text_encoder", "--learning_rate_te1", "1e-5")
    settings = config("--learning_rate", "1", "--prodigy_d_coef", "0.5", "--prodigy_growth_rate", "1.02", "--prodigy_safeguard_warmup").prodigy_settings()
    assert settings == ProdigySettings(d0=1e-6, d_coef=0.5, growth_rate=1.02, use_bias_correction=False, safeguard_warmup=True)
    assert config("--learning_rate", "1").prodigy_settings().growth_rate == float("inf")
