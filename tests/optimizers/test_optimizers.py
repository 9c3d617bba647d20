"""Our Adafactor and Lion against their references: transformers' Adafactor with the settings kohya
sd-scripts users pass, and Lion's update as the paper writes it; Lion's multi-tensor step in chunks
equals one over all parameters; our AdamW on local shards is torch's fused AdamW over DTensors.
(Sharded steps: test_train_step.py and test_train_step_distributed.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers.optimization import Adafactor as TransformersAdafactor

from sdxl_trainer.optimizers import lion
from sdxl_trainer.optimizers.adafactor import Adafactor
from sdxl_trainer.optimizers.adamw import ShardAdamW
from sdxl_trainer.optimizers.lion import Lion

STEPS = 4


def weights_and_gradients(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A linear layer's weight and bias, a conv kernel, and each one's gradient for every step."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (24,), (6, 4, 3, 3)]
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    gradients = [[torch.randn(shape, generator=generator) * (step + 1) for shape in shapes] for step in range(STEPS)]
    return weights, gradients


def trained(optimizer_class, weights: list[torch.Tensor], gradients: list[list[torch.Tensor]], **settings) -> list[torch.Tensor]:
    parameters = [torch.nn.Parameter(weight.clone()) for weight in weights]
    optimizer = optimizer_class(parameters, **settings)
    for step_gradients in gradients:
        for parameter, gradient in zip(parameters, step_gradients):
            parameter.grad = gradient.clone()
        optimizer.step()
    return [parameter.detach() for parameter in parameters]


@pytest.mark.parametrize("learning_rate", [1e-3, 0.3])  # the update clipped at an RMS of 1, and not
def test_adafactor_gives_transformers_update_for_linear_weights_and_biases(learning_rate):
    weights, gradients = weights_and_gradients()
    weights, gradients = weights[:2], [step[:2] for step in gradients]
    ours = trained(Adafactor, weights, gradients, lr=learning_rate, weight_decay=0.01)
    theirs = trained(
        TransformersAdafactor, weights, gradients, lr=learning_rate, weight_decay=0.01,
        relative_step=False, scale_parameter=False, warmup_init=False,
    )  # fmt: skip
    for our_weight, their_weight, start in zip(ours, theirs, weights):
        assert not torch.equal(our_weight, start)
        torch.testing.assert_close(our_weight, their_weight, rtol=1e-6, atol=1e-6 * learning_rate)


def test_adafactor_factors_a_conv_kernel_over_its_output_channels_and_the_rest():
    weights, gradients = weights_and_gradients()
    parameter = torch.nn.Parameter(weights[2].clone())
    optimizer = Adafactor([parameter], lr=1e-3)
    parameter.grad = gradients[0][2]
    optimizer.step()
    state = optimizer.state[parameter]
    assert state["exp_avg_sq_row"].shape == (6,) and state["exp_avg_sq_col"].shape == (4 * 3 * 3,)
    squared = gradients[0][2].square() + 1e-30
    torch.testing.assert_close(state["exp_avg_sq_row"], squared.flatten(1).mean(1))  # the first step takes it whole
    torch.testing.assert_close(state["exp_avg_sq_col"], squared.flatten(1).mean(0))


def test_lion_gives_the_papers_update():
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1 - b1) g; w -= lr (sign(c) + wd w); m = b2 m + (1 - b2) g."""
    weights, gradients = weights_and_gradients()
    learning_rate, weight_decay, (beta1, beta2) = 1e-3, 0.1, (0.9, 0.99)
    ours = trained(Lion, weights, gradients, lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay)
    expected, momenta = [weight.clone() for weight in weights], [torch.zeros_like(weight) for weight in weights]
    for step_gradients in gradients:
        for weight, momentum, gradient in zip(expected, momenta, step_gradients):
            interpolation = beta1 * momentum + (1 - beta1) * gradient
            weight -= learning_rate * (torch.sign(interpolation) + weight_decay * weight)
            momentum.mul_(beta2).add_((1 - beta2) * gradient)
    for our_weight, expected_weight in zip(ours, expected):
        torch.testing.assert_close(our_weight, expected_weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_lion_stepped_in_chunks_equals_one_step_over_all_parameters(monkeypatch, weights_dtype):
    """Chunks of at most 300 values (the 384-value weight alone, then the bias and the conv kernel together)
    change nothing, stochastic rounding included."""
    weights, gradients = weights_and_gradients()
    weights = [weight.to(weights_dtype) for weight in weights]
    gradients = [[gradient.to(weights_dtype) for gradient in step] for step in gradients]
    whole = trained(Lion, weights, gradients, lr=1e-2)
    monkeypatch.setattr(lion, "CHUNK_VALUES", 300)
    chunked = trained(Lion, weights, gradients, lr=1e-2)
    for whole_weight, chunked_weight, start in zip(whole, chunked, weights):
        assert torch.equal(whole_weight, chunked_weight)
        assert not torch.equal(whole_weight, start)


def test_adamw_on_local_shards_is_torchs_fused_adamw_over_dtensors_bit_for_bit(world):
    """Same weights and same state (DTensors laid out as the weights, the step a float32 scalar), so a
    checkpoint of either resumes on the other."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    weights, gradients = weights_and_gradients()
    settings = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    runs = {}
    for name, make in {"ours": ShardAdamW, "torch": lambda parameters, **kw: torch.optim.AdamW(parameters, fused=True, **kw)}.items():
        parameters = [torch.nn.Parameter(distribute_tensor(weight.clone(), world.mesh, [Shard(0)])) for weight in weights]
        optimizer = make(parameters, **settings)
        for step_gradients in gradients:
            for parameter, gradient in zip(parameters, step_gradients):
                parameter.grad = distribute_tensor(gradient.clone(), world.mesh, [Shard(0)])
            optimizer.step()
        runs[name] = (parameters, optimizer)
    (ours, our_optimizer), (reference, torch_optimizer) = runs["ours"], runs["torch"]
    assert all(not torch.equal(parameter.full_tensor(), weight) for parameter, weight in zip(ours, weights))  # trained
    for parameter, expected in zip(ours, reference):
        assert torch.equal(parameter.full_tensor(), expected.full_tensor())
        state, expected_state = our_optimizer.state[parameter], torch_optimizer.state[expected]
        assert set(state) == set(expected_state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].dtype == expected_state["step"].dtype == torch.float32 and state["step"].item() == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and state[key].placements == expected_state[key].placements
            assert torch.equal(state[key].full_tensor(), expected_state[key].full_tensor())
