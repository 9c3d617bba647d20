"""Our Adafactor, Lion and CAME against their references: transformers' Adafactor with the settings kohya
sd-scripts users pass, Lion's update as the paper writes it, and came_pytorch.CAME (the authors' code, a
test dependency only) on the same tensors; Lion's multi-tensor step in chunks equals one over all
parameters; our AdamW on local shards is torch's fused AdamW over DTensors. (Sharded steps, and the
factored optimizers' shards on 2 processes against the whole tensors: test_train_step.py and
test_train_step_distributed.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from came_pytorch import CAME as ReferenceCAME
from transformers.optimization import Adafactor as TransformersAdafactor

from conftest import REPO_ROOT

from sdxl_trainer.estimates.host_work import HostWork
from sdxl_trainer.optimizers import lion
from sdxl_trainer.optimizers.adafactor import Adafactor
from sdxl_trainer.optimizers.adamw import ShardAdamW
from sdxl_trainer.optimizers.build import OPTIMIZERS, _stored_bytes, build_optimizer
from sdxl_trainer.optimizers.came import CAME
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


def copies_of_each_shape(copies: int, seed: int = 1) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """weights_and_gradients' three shapes, `copies` tensors of each (interleaved, as a model's layers are)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (24,), (6, 4, 3, 3)] * copies
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    gradients = [[torch.randn(shape, generator=generator) * (step + 1) for shape in shapes] for step in range(STEPS)]
    return weights, gradients


@pytest.mark.parametrize("optimizer_class", [Adafactor, CAME])
def test_same_shaped_tensors_stepped_together_move_as_each_stepped_alone(optimizer_class):
    """Adafactor and CAME stack same-shaped tensors and step them at once (shards.StackedRun): each tensor's
    statistics, RMS clipping and update are still its own, as from an optimizer of its own."""
    weights, gradients = copies_of_each_shape(3)
    together = trained(optimizer_class, weights, gradients, lr=1e-3, weight_decay=0.01)
    for number, (weight, moved) in enumerate(zip(weights, together)):
        (alone,) = trained(optimizer_class, [weight], [[step[number]] for step in gradients], lr=1e-3, weight_decay=0.01)
        assert not torch.equal(moved, weight)
        assert torch.equal(moved, alone), number


@pytest.mark.parametrize("optimizer_class", [Adafactor, CAME])
def test_a_factored_step_dispatches_per_shape_not_per_tensor(optimizer_class):
    """The step over ten tensors of each shape dispatches as many operators as over one of each (stepped tensor
    by tensor, Adafactor dispatched about 21 per tensor: 34,754 per update at SDXL's 1,680 tensors, in 44
    shapes). Counted as TrainStep calls it, with the update's verdict on the device."""

    def step_operators(copies: int) -> int:
        weights, gradients = copies_of_each_shape(copies)
        parameters = [torch.nn.Parameter(weight) for weight in weights]
        optimizer = optimizer_class(parameters, lr=1e-3)
        for step_gradients in gradients[:2]:  # the first makes the state; the second is counted
            for parameter, gradient in zip(parameters, step_gradients):
                parameter.grad = gradient
            with HostWork(by_part=False) as counts:
                optimizer.step(finite=torch.tensor(True))
        return counts.total_ops

    assert step_operators(10) == step_operators(1)


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
    change nothing in the step. bf16 weights are rounded a chunk at a time, keyed by the chunk's first tensor,
    so other chunks draw other random bits: each update's rounding then lands at most one bf16 step away."""
    weights, gradients = weights_and_gradients()
    weights = [weight.to(weights_dtype) for weight in weights]
    gradients = [[gradient.to(weights_dtype) for gradient in step] for step in gradients]
    whole = trained(Lion, weights, gradients, lr=1e-2)
    monkeypatch.setattr(lion, "CHUNK_VALUES", 300)
    chunked = trained(Lion, weights, gradients, lr=1e-2)
    for whole_weight, chunked_weight, start in zip(whole, chunked, weights):
        assert not torch.equal(whole_weight, start)
        if weights_dtype == torch.float32:
            assert torch.equal(whole_weight, chunked_weight)
            continue
        # bf16 keeps 8 significant bits: one step at a magnitude below 2^e is 2^(e - 8)
        magnitude = torch.maximum(whole_weight.abs(), start.abs()).float() + STEPS * 1e-2  # Lion moves a weight by lr an update
        bf16_step = torch.exp2((torch.frexp(magnitude).exponent - 8).float())
        assert torch.all((whole_weight.float() - chunked_weight.float()).abs() <= STEPS * bf16_step)


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


@pytest.mark.parametrize("learning_rate", [1e-3, 0.3])  # the normalised update clipped at an RMS of 1, and not
def test_came_gives_the_references_update_for_linear_weights_and_biases(learning_rate):
    weights, gradients = weights_and_gradients()
    weights, gradients = weights[:2], [step[:2] for step in gradients]
    settings = dict(lr=learning_rate, betas=(0.9, 0.999, 0.9999), weight_decay=0.01)
    ours = trained(CAME, weights, gradients, **settings)
    theirs = trained(ReferenceCAME, weights, gradients, **settings)
    for our_weight, their_weight, start in zip(ours, theirs, weights):
        assert not torch.equal(our_weight, start)
        # CAME moves weights by many times the learning rate: a few ulps of the largest weight
        torch.testing.assert_close(our_weight, their_weight, rtol=1e-6, atol=1e-6 * start.abs().max().item())


def test_came_steps_a_conv_kernel_as_the_reference_steps_its_output_channels_by_the_rest():
    """Factored over (dim 0, the other dims flattened): the reference's update of the (6, 4*3*3) matrix."""
    weights, gradients = weights_and_gradients()
    kernel, kernel_gradients = weights[2], [step[2] for step in gradients]
    (ours,) = trained(CAME, [kernel], [[gradient] for gradient in kernel_gradients], lr=1e-3)
    (theirs,) = trained(ReferenceCAME, [kernel.flatten(1)], [[gradient.flatten(1)] for gradient in kernel_gradients], lr=1e-3)
    assert not torch.equal(ours, kernel)
    torch.testing.assert_close(ours.flatten(1), theirs, rtol=1e-6, atol=1e-6 * kernel.abs().max().item())


def test_a_skipped_first_update_keeps_weights_and_state_and_the_next_one_steps_as_the_first():
    """Before any update the moments are zeros, whose normalised gradient is 0/0: a skipped update must not
    let that into the momentum or the weights. The update after it then steps as a first update does."""
    weights, gradients = weights_and_gradients()
    parameters = [torch.nn.Parameter(weight.clone()) for weight in weights]
    optimizer = CAME(parameters, lr=1e-3)
    for parameter, gradient in zip(parameters, gradients[0]):
        parameter.grad = gradient.clone()
    optimizer.step(finite=torch.tensor(False))
    assert all(torch.equal(parameter, weight) for parameter, weight in zip(parameters, weights))
    assert all(torch.count_nonzero(value) == 0 for state in optimizer.state.values() for value in state.values())
    for parameter, gradient in zip(parameters, gradients[1]):
        parameter.grad = gradient.clone()
    optimizer.step(finite=torch.tensor(True))
    first = trained(CAME, weights, gradients[1:2], lr=1e-3)
    assert all(torch.equal(parameter.detach(), expected) for parameter, expected in zip(parameters, first))


def test_the_state_table_of_training_md_is_what_each_optimizer_makes_for_the_sdxl_unet():
    """docs/training.md's "full-size SDXL UNet state" column: the state each optimizer creates for the full-size
    UNet's parameters (on the meta device: shapes only), on one GPU, in GiB as the table rounds it."""
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG

    with torch.device("meta"):
        parameters = list(UNet2DConditionModel(**SDXL_UNET_CONFIG).parameters())
    table = dict(re.findall(r"^\s*\| `(\w+)`[^|]*\|[^|]*\| ([\d.]+) GiB \|", (REPO_ROOT / "docs" / "training.md").read_text(), re.MULTILINE))
    assert set(table) == set(OPTIMIZERS)
    for name in OPTIMIZERS:
        optimizer = build_optimizer(name, parameters, 1e-5, 0.0, (0.9, None), 1e-8)
        if name == "adamw8bit":  # torchao's state constructor, as its first step calls it
            states = [{"exp_avg": optimizer._new_buffer(p, True), "exp_avg_sq": optimizer._new_buffer(p, False)} for p in parameters]
        else:
            states = [optimizer._new_state(parameter) for parameter in parameters]
        state_bytes = sum(_stored_bytes(value) for state in states for value in state.values() if value.ndim > 0)
        decimals = len(table[name].split(".")[1])
        assert round(state_bytes / 2**30, decimals) == float(table[name]), f"{name}: {state_bytes / 2**30:.3f} GiB"
