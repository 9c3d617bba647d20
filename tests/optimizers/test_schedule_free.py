"""Our schedule-free AdamW against schedulefree's AdamWScheduleFree (a test dependency only) on the same tensors
and gradients: the trained weights (y) and the evaluation weights (x, its eval()); on DTensors as on plain
tensors; the schedules it refuses. (The trainer's use of x: tests/training/test_schedule_free_evaluation.py;
2 ranks against 1 process: tests/distributed/test_optimizer_shards.py.)"""

from __future__ import annotations

import pytest
import torch
from schedulefree import AdamWScheduleFree

from sdxl_trainer.config import parse_config
from sdxl_trainer.optimizers.schedule_free import LR_MAX, SHARED, UPDATES, WEIGHT_SUM, ScheduleFreeAdamW

UPDATES_RUN = 8
PEAK_RATE = 1e-2


def weights_and_gradients(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A linear layer's weight and bias, a conv kernel, and each one's gradient for every update."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (24,), (6, 4, 3, 3)]
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    gradients = [[torch.randn(shape, generator=generator) * (update + 1) for shape in shapes] for update in range(UPDATES_RUN)]
    return weights, gradients


def rate(update: int) -> float:
    """The trainer's constant_with_warmup over 3 updates: 0 first, the peak from the fourth."""
    return PEAK_RATE * min(1.0, update / 3)


def trained(make_optimizer, weights: list[torch.Tensor], gradients: list[list[torch.Tensor]]) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    parameters = [torch.nn.Parameter(weight.clone()) for weight in weights]
    optimizer = make_optimizer(parameters)
    for update, update_gradients in enumerate(gradients):
        for parameter, gradient in zip(parameters, update_gradients):
            parameter.grad = gradient.clone()
        for group in optimizer.param_groups:
            group["lr"] = rate(update)
        optimizer.step()
    return parameters, optimizer


def reference(parameters: list[torch.nn.Parameter]) -> AdamWScheduleFree:
    """schedulefree with its own warm-up off: the trainer's schedule sets each update's rate, as above."""
    optimizer = AdamWScheduleFree(parameters, lr=PEAK_RATE, weight_decay=0.01, warmup_steps=0)
    optimizer.train()
    return optimizer


def test_schedule_free_adamw_gives_schedulefrees_trained_and_evaluation_weights():
    weights, gradients = weights_and_gradients()
    ours, optimizer = trained(lambda parameters: ScheduleFreeAdamW(parameters, lr=PEAK_RATE, weight_decay=0.01), weights, gradients)
    theirs, their_optimizer = trained(reference, weights, gradients)
    for our_weight, their_weight, start in zip(ours, theirs, weights):
        assert (their_weight - start).abs().max() > 1e-2
        torch.testing.assert_close(our_weight.detach(), their_weight.detach(), rtol=1e-6, atol=1e-7)  # y
    evaluated = optimizer.evaluation_weights(ours)
    trained_weights = [parameter.detach().clone() for parameter in ours]
    their_optimizer.eval()  # x into their parameters
    for our_x, their_x, our_y in zip(evaluated, theirs, trained_weights):
        assert not torch.equal(our_x, our_y)
        torch.testing.assert_close(our_x, their_x.detach(), rtol=1e-6, atol=1e-7)
    assert all(torch.equal(parameter, y) for parameter, y in zip(ours, trained_weights))  # asking for x leaves y
    group, shared = their_optimizer.param_groups[0], optimizer.state[ours[0]][SHARED]
    assert shared[UPDATES].item() == group["k"] == UPDATES_RUN  # every update counts, the first (at rate 0) too
    assert shared[WEIGHT_SUM].item() == pytest.approx(group["weight_sum"], rel=1e-12)
    assert shared[LR_MAX].item() == group["lr_max"] == PEAK_RATE


def test_before_any_update_the_evaluation_weights_are_the_weights():
    parameter = torch.nn.Parameter(torch.randn(5, 3))
    evaluated = ScheduleFreeAdamW([parameter], lr=1e-3).evaluation_weights([parameter])
    assert torch.equal(evaluated[0], parameter.detach()) and evaluated[0].data_ptr() != parameter.data_ptr()


def test_dtensor_shards_step_as_plain_tensors(world):
    from torch.distributed.tensor import Shard, distribute_tensor

    weights, gradients = weights_and_gradients(1)
    plain, plain_optimizer = trained(lambda parameters: ScheduleFreeAdamW(parameters, lr=PEAK_RATE), weights, gradients)
    sharded, optimizer = trained(
        lambda parameters: ScheduleFreeAdamW(parameters, lr=PEAK_RATE),
        [distribute_tensor(weight, world.mesh, [Shard(0)]) for weight in weights],
        [[distribute_tensor(gradient, world.mesh, [Shard(0)]) for gradient in update] for update in gradients],
    )
    for parameter, expected, evaluated, expected_evaluated in zip(
        sharded, plain, optimizer.evaluation_weights(sharded), plain_optimizer.evaluation_weights(plain)
    ):
        assert torch.equal(parameter.full_tensor(), expected.detach())
        assert torch.equal(evaluated, expected_evaluated)  # the local shard's, which is the whole tensor on one rank
        assert optimizer.state[parameter]["z"].placements == (Shard(0),)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "polynomial", "cosine_with_restarts"])
def test_schedule_free_refuses_a_decaying_schedule(schedule, capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", "adamw_schedulefree", "--learning_rate_scheduler", schedule])
    assert "use --learning_rate_scheduler constant_with_warmup (or constant)" in capsys.readouterr().err
    for allowed in ("constant", "constant_with_warmup"):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", "adamw_schedulefree", "--learning_rate_scheduler", allowed])
