"""--weights_dtype bf16: stochastic rounding (sdxl_trainer/stochastic_rounding.py) in every optimizer,
training of the tiny UNet against fp32 weights, exact resume, and the trainer's flag checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from unet_batches import make_train_step, save_training_state, saved_state_of, synthetic_batch, trainer_state_for

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.fsdp import prepare_unet, shard_unet
from sdxl_trainer.estimates.host_work import HostWork
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer
from sdxl_trainer.optimizers.prodigy import ProdigySettings
from sdxl_trainer.optimizers.stochastic_rounding import round_to_bf16, rounding_key, rounding_keys
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.gradient_norm import clip_gradients

BF16_STEP_AT_1 = 2.0**-7  # bf16 keeps 8 significant bits: its spacing between 1 and 2


@pytest.mark.slow
def test_rounding_goes_up_as_often_as_the_share_of_the_step_passed():
    values = 1.0 + BF16_STEP_AT_1 * torch.tensor([0.0, 0.125, 0.5, 0.9]).repeat_interleave(40_000)
    rounded = round_to_bf16(values, rounding_key(step=1, stream=0)).float().view(4, -1)
    went_up = (rounded == 1.0 + BF16_STEP_AT_1).float().mean(1)
    assert torch.all((rounded == 1.0) | (rounded == 1.0 + BF16_STEP_AT_1))  # only the two neighbours
    for share, expected in zip(went_up.tolist(), [0.0, 0.125, 0.5, 0.9]):
        assert share == pytest.approx(expected, abs=4 * math.sqrt(0.25 / 40_000))  # 4 standard deviations
    # Negative values round their magnitude the same way; exact bf16 values stay as they are.
    negative = round_to_bf16(-values[40_000:80_000], rounding_key(step=1, stream=0)).float()
    assert (negative == -1.0 - BF16_STEP_AT_1).float().mean().item() == pytest.approx(0.125, abs=0.01)
    exact = torch.randn(10_000).bfloat16()
    assert torch.equal(round_to_bf16(exact.float(), rounding_key(step=5, stream=3)), exact)


def test_the_key_fixes_the_rounding_and_another_key_redraws_it():
    values = torch.randn(50_000)
    first = round_to_bf16(values, rounding_key(step=7, stream=2))
    assert torch.equal(first, round_to_bf16(values, rounding_key(step=7, stream=2)))
    for other in (rounding_key(step=8, stream=2), rounding_key(step=7, stream=3)):
        assert (round_to_bf16(values, other) != first).float().mean().item() > 0.2
    errors = first.float() - values
    assert abs(errors.mean().item()) < 0.02 * errors.abs().mean().item()  # unbiased, unlike truncation
    # An update's keys hashed together on the device (from a float step count, as the optimizers keep it),
    # each picked by its index inside the kernel: the same keys, the same rounding.
    keys = rounding_keys(torch.tensor(7.0), [5, 2, 3])
    assert keys.tolist() == [rounding_key(step=7, stream=stream) for stream in (5, 2, 3)]
    assert torch.equal(round_to_bf16(values, keys, 1), first)
    assert torch.equal(round_to_bf16(values, rounding_keys(torch.tensor([1.0, 7.0]), [9, 2]), 1), first)


def test_every_shape_dtype_and_layout_rounds_through_one_compiled_graph():
    """A long run (or a test session) rounds tensors of every dimensionality, weights' dtype and layout: each
    kind once a graph of its own, the eighth kind hit Dynamo's recompile limit, a hard error under fullgraph
    (the suite's Lion and Adafactor resume tests failed so). Positions stay row-major: a tensor rounds as its
    flattened copy does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() leaves the counts of graphs compiled before it (other tests in this process)
    shapes = [(7,), (3, 5), (2, 3, 4), (2, 3, 2, 2), (4, 4), (1, 9, 2)]
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            values = torch.randn(shape, dtype=dtype)
            for layout in (values, values.transpose(0, -1), values[..., :1]):
                rounded = round_to_bf16(layout, rounding_key(step=3, stream=1))
                assert rounded.shape == layout.shape
                assert torch.equal(rounded.reshape(-1), round_to_bf16(layout.reshape(-1).clone(), rounding_key(step=3, stream=1)))
    # one graph for every length, and Dynamo's own one for a length of 1 (it specialises sizes 0 and 1)
    assert counters["stats"]["unique_graphs"] == 2
    keys = rounding_keys(torch.tensor(3.0), list(range(12)))
    for index in range(12):  # the optimizers' form, a key picked from the update's: one more graph for every index
        values = torch.randn(5 + index)
        assert torch.equal(round_to_bf16(values, keys, index), round_to_bf16(values, rounding_key(step=3, stream=index)))
    assert counters["stats"]["unique_graphs"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_updates_below_half_a_bf16_step_land_in_expectation(optimizer_name):
    """Weights at 1.0, a constant gradient: every optimizer here moves a weight by about lr per update
    (Adam's normalised step, Lion's sign, Adafactor's clipped RMS of 1; Prodigy with its step size held at 1
    and Adam's bias correction), CAME by a few times that (its momentum over the root of a small
    instability), schedule-free AdamW's trained weights (y) by about half that, and lr is 1.3% of a bf16
    step. Rounded to nearest, the weights never move (torch's AdamW on bf16 weights); rounded
    stochastically, their mean follows the fp32 trajectory."""
    learning_rate, updates = BF16_STEP_AT_1 / 78, 60
    shapes = [(64, 128), (300,)]  # 8-bit moments for the first with adamw8bit, fp32 ones for the second
    # d0 1 and estimates scaled to nothing: d stays 1, so the step is lr (the bias correction makes it Adam's).
    prodigy = ProdigySettings(d0=1.0, d_coef=1e-12, use_bias_correction=True)

    def train(make_optimizer, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
        weights = [torch.nn.Parameter(torch.ones(shape, dtype=dtype)) for shape in shapes]
        optimizer = make_optimizer(weights)
        for _ in range(updates):
            for weight in weights:
                weight.grad = torch.ones_like(weight)
            optimizer.step()
        return [weight.detach().float() for weight in weights]

    def ours(weights):
        return build_optimizer(optimizer_name, weights, learning_rate, 0.0, (0.9, None), 1e-8, prodigy=prodigy)

    stochastic, exact = train(ours), train(ours, torch.float32)
    nearest = train(lambda weights: torch.optim.AdamW(weights, lr=learning_rate, weight_decay=0.0, foreach=True))
    for moved, moved_exactly, stayed in zip(stochastic, exact, nearest):
        assert torch.all(stayed == 1.0)
        assert 1.0 - moved_exactly.mean().item() > 0.4 * updates * learning_rate
        assert 1.0 - moved.mean().item() == pytest.approx(1.0 - moved_exactly.mean().item(), rel=0.1)


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_rounding_into_bf16_weights_costs_no_operator_per_chunk_or_tensor(optimizer_name, monkeypatch):
    """An update's rounding keys are hashed together, once, and each rounding picks its own inside the compiled
    kernel; hashed one by one they cost about 23 operators each: per chunk in the 8-bit AdamW (4,850 per
    update at SDXL's 211 chunks on one GPU), per tensor in Lion, Prodigy and schedule-free AdamW, which
    rounded tensor by tensor and now round a chunk at once (40,000 per update at SDXL's 1,680 tensors), and
    in Adafactor and CAME, which now step and round runs of same-shaped tensors. Measured as what bf16 weights
    add to the operators of a step over fp32 weights, for 10 tensors in one chunk and for 100 in ten chunks.
    What is left per chunk is the casts to fp32 of the bf16 values a step flattens or stacks."""
    for module in ("adamw8bit", "lion", "prodigy", "schedule_free"):
        monkeypatch.setattr(f"sdxl_trainer.optimizers.{module}.CHUNK_VALUES", 33 * 7 * 10)  # chunks of 10 tensors
    monkeypatch.setattr("sdxl_trainer.optimizers.shards.FACTORED_RUN_VALUES", 33 * 7 * 10)  # Adafactor's and CAME's runs
    generator = torch.Generator().manual_seed(0)

    def step_operators(count: int, dtype: torch.dtype) -> int:
        params = [torch.nn.Parameter(torch.randn(33, 7, generator=generator).to(dtype)) for _ in range(count)]
        optimizer = build_optimizer(optimizer_name, params, 1e-3, 0.0, (0.9, None), 1e-8, prodigy=ProdigySettings())
        for update in range(3):  # the first makes the state; the third is counted
            for param in params:
                param.grad = torch.randn(33, 7, generator=generator).to(dtype)
            with HostWork(by_part=False) as counts:
                optimizer.step()
        return counts.total_ops

    added_by_bf16 = {count: step_operators(count, torch.bfloat16) - step_operators(count, torch.float32) for count in (10, 100)}
    # Per chunk, the casts to fp32 of the bf16 values it flattens or stacks (0-4); was 23 in the 8-bit AdamW, 241 in
    # Lion, and 28 per tensor in Adafactor and CAME.
    assert (added_by_bf16[100] - added_by_bf16[10]) / 9 <= 4


def loss_trajectory(world, pipeline_dir, weights_dtype: torch.dtype, optimizer_factory, updates: int = 30) -> np.ndarray:
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet", dtype=weights_dtype)
    prepare_unet(unet, world, torch.bfloat16)
    step = make_train_step(unet, optimizer_factory(unet.parameters()), pipeline_dir)
    # 8 items seen again every 4 updates: the loss falls fast enough to tell the runs apart in 30 updates. 8x8
    # latents: the gap is wider than at 16x16 (after 50 updates 35% against 24%) in less than half the time.
    return np.array([step([synthetic_batch(unet, [update % 4, update % 4 + 4], seed=3, height=8, width=8)], epoch=0).loss for update in range(updates)])


@pytest.mark.slow
def test_bf16_weights_train_the_tiny_unet_as_fp32_weights_do(world, tiny_pipeline_dir):
    """30 AdamW updates at lr 1e-4 (below half a bf16 step of most of the tiny UNet's weights), bf16 compute
    in all three runs. Measured: the last 10 losses average 0.5897 with fp32 weights, 0.5904 with bf16 +
    stochastic rounding and 0.6937 rounded to nearest (18% above; 35% after 50 updates). The tolerance, 1%,
    is under a tenth of that gap."""
    rate = 1e-4
    fp32 = loss_trajectory(world, tiny_pipeline_dir, torch.float32, lambda params: build_optimizer("adamw", params, rate, 0.0, (0.9, None), 1e-8))
    stochastic = loss_trajectory(world, tiny_pipeline_dir, torch.bfloat16, lambda params: build_optimizer("adamw", params, rate, 0.0, (0.9, None), 1e-8))
    nearest = loss_trajectory(world, tiny_pipeline_dir, torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=rate, weight_decay=0.0, foreach=True))
    final = {name: losses[-10:].mean() for name, losses in (("fp32", fp32), ("stochastic", stochastic), ("nearest", nearest))}
    print(f"mean of the last 10 losses: {final}")
    assert final["fp32"] < 0.8 * fp32[:10].mean()  # the run learns
    assert final["stochastic"] == pytest.approx(final["fp32"], rel=0.01)
    assert final["nearest"] > 1.1 * final["fp32"]  # what stochastic rounding is for


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("layout", ["fsdp2", "plain"])
def test_bf16_weights_resume_exactly(world, tiny_pipeline_dir, tmp_path, optimizer_name, layout):
    """"4 updates straight" equals "3 updates, save, restore, 1 update" bit for bit: the rounding of the
    resumed update is keyed by the restored step counts. FSDP2's DTensor shards and the plain module."""
    from sdxl_trainer.state.load import load_training_state

    def fresh():
        unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet", dtype=torch.bfloat16)
        if layout == "fsdp2":
            shard_unet(unet, world.mesh, param_dtype=torch.bfloat16)
        else:
            prepare_unet(unet, world, torch.bfloat16)
        # Prodigy's rate multiplies its estimate of the step size, which starts at 1e-6.
        optimizer = build_optimizer(optimizer_name, unet.parameters(), 1.0 if optimizer_name == "prodigy" else 1e-4, 1e-2, (0.9, None), 1e-8)
        ema = ShardedEMA(unet, decay=0.9, on_cpu=False)
        return unet, optimizer, ema, make_train_step(unet, optimizer, tiny_pipeline_dir, ema=ema)

    def weights(unet) -> dict[str, torch.Tensor]:
        return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone() for name, value in unet.named_parameters()}

    unet, optimizer, ema, step = fresh()
    for update in range(3):  # more than one: a resumed step count that is not the restored one shows in the rounding
        step([synthetic_batch(unet, [0, 1], seed=update, height=16, width=16)], epoch=0)
    save_training_state(tmp_path / "checkpoint", unet, optimizer, ema, *saved_state_of(step, optimizer_name, 1))
    step([synthetic_batch(unet, [2, 3], seed=3, height=16, width=16)], epoch=0)
    straight, straight_ema = weights(unet), ema.full_state_dict_on_rank0(True)
    assert all(value.dtype == torch.bfloat16 for value in straight.values())

    unet, optimizer, ema, step = fresh()
    load_training_state(tmp_path / "checkpoint", unet, optimizer, ema)
    step([synthetic_batch(unet, [2, 3], seed=3, height=16, width=16)], epoch=0)
    resumed = weights(unet)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    assert all(torch.equal(straight_ema[name], value) for name, value in ema.full_state_dict_on_rank0(True).items())


def test_bf16_weights_need_bf16_compute_and_the_same_dtype_on_resume(capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig, resolve_compute_dtype
    from sdxl_trainer.state.checkpointer import resume_problems

    def config(*flags: str) -> TrainConfig:
        return parse_config(TrainConfig, ["--cached_dataset_dirs", "c", *flags])

    def problems_resuming(saved, run: TrainConfig) -> list[str]:
        return resume_problems(saved, run.run_facts(world_size=1), run.set_seed)

    # auto computes in fp32 on a CPU, but bf16 weights compute in bf16 wherever they are
    assert resolve_compute_dtype(config("--weights_dtype", "bf16").mixed_precision, torch.device("cpu"), "bf16") == torch.bfloat16
    assert config("--weights_dtype", "bf16", "--mixed_precision", "bf16").weights_dtype == "bf16"
    with pytest.raises(SystemExit):
        config("--weights_dtype", "bf16", "--mixed_precision", "fp16")
    assert "--weights_dtype bf16 computes in bf16: drop --mixed_precision fp16 (or pass bf16), or keep fp32 weights" in capsys.readouterr().err
    assert problems_resuming(trainer_state_for(weights_dtype="bf16"), config("--weights_dtype", "bf16")) == []
    assert problems_resuming(trainer_state_for(), config("--weights_dtype", "bf16")) == ["the checkpoint holds fp32 weights: resume with --weights_dtype fp32"]


def test_clipping_bf16_gradients_measures_in_fp32_with_no_operator_per_tensor():
    """bf16 gradients' norms come out of one foreach op in fp32: cast one by one from bf16 they cost an operator
    per tensor (1,680 per update at SDXL's count) and were each rounded to 8 bits first."""
    generator = torch.Generator().manual_seed(0)

    def clipped(count: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        params = [torch.nn.Parameter(torch.zeros(33, 7, dtype=torch.bfloat16)) for _ in range(count)]
        for param in params:
            param.grad = torch.randn(33, 7, generator=generator).to(torch.bfloat16)
        expected = torch.cat([param.grad.float().flatten() for param in params]).norm()
        with HostWork(by_part=False) as counts:
            norm = clip_gradients(params, max_norm=1e-3)
        return norm, expected, counts.total_ops

    (norm_10, expected_10, ops_10), (norm_100, expected_100, ops_100) = clipped(10), clipped(100)
    assert ops_10 == ops_100  # the same operators for 10 tensors as for 100
    for norm, expected in ((norm_10, expected_10), (norm_100, expected_100)):
        assert norm.dtype == torch.float32
        assert norm.item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_ema_averages_bf16_weights_in_runs_as_each_tensor_cast_on_its_own(monkeypatch):
    """A run of bf16 weights is cast to fp32 in one operator: the same average, bit for bit, as each tensor cast
    on its own (the code before), and the same operators for 10 tensors as for 100; a run holds at most
    EVALUATION_RUN_VALUES values, so no whole fp32 copy of the weights is made at once."""
    import sdxl_trainer.training.ema as ema_module

    generator = torch.Generator().manual_seed(0)

    def averaged(count: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(33, 7, generator=generator).to(torch.bfloat16)) for _ in range(count)])
        ema = ShardedEMA(model, decay=0.5, on_cpu=False)
        with torch.no_grad():
            for param in model:
                param.copy_(torch.randn(33, 7, generator=generator))
        expected = [shadow.lerp(param.float(), 1 - ema.current_decay()) for shadow, param in zip(ema.shadow, model)]
        with HostWork(by_part=False) as counts:
            ema.update(torch.ones((), dtype=torch.bool))
        return ema.shadow, expected, counts.total_ops

    shadow_10, expected_10, ops_10 = averaged(10)
    shadow_100, expected_100, ops_100 = averaged(100)
    assert ops_10 == ops_100
    assert all(torch.equal(got, want) for got, want in zip(shadow_10 + shadow_100, expected_10 + expected_100))
    monkeypatch.setattr(ema_module, "EVALUATION_RUN_VALUES", 33 * 7 * 10)  # runs of 10 tensors: 10 runs for 100
    shadow_runs, expected_runs, ops_runs = averaged(100)
    assert ops_10 < ops_runs <= 10 * ops_10  # grows with the runs, not with the tensors
    assert all(torch.equal(got, want) for got, want in zip(shadow_runs, expected_runs))
