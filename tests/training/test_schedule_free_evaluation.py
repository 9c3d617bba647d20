"""Schedule-free AdamW in the trainer: the UNet trains at y, while the export, validation and the EMA use the
evaluation weights x. Four updates of the tiny UNet (FSDP2 on one rank) through TrainStep, replayed by
schedulefree's AdamWScheduleFree (a test dependency only) with the same gradients and rates: the exported
pipeline holds its eval() weights, the EMA averages them, and training's own weights come back bit for bit."""

from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file
from schedulefree import AdamWScheduleFree
from unet_batches import empty_prompt_for, synthetic_batch

from sdxl_trainer.distributed.fsdp import parameter_names, shard_unet
from sdxl_trainer.distributed.local_shard import local_shard
from sdxl_trainer.optimizers.build import build_optimizer, evaluation_weights_of
from sdxl_trainer.outputs.export import Exporter, ExportSettings
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.loss import build_noise_scheduler
from sdxl_trainer.training.lr_schedule import LearningRateSchedule
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.step import TrainStep
from sdxl_trainer.training.trained_models import TrainedModels

PEAK_RATE, UPDATES, EMA_DECAY = 1e-3, 4, 0.9
SCHEDULE = LearningRateSchedule("constant_with_warmup", PEAK_RATE, warmup_updates=2, total_updates=UPDATES)


def trained_weights(unet) -> dict[str, torch.Tensor]:
    return {name: parameter.full_tensor().detach().clone() for name, parameter in zip(parameter_names(unet), unet.parameters())}


def test_exports_validation_and_the_ema_use_schedulefrees_evaluation_weights(world, tiny_pipeline_dir, tmp_path):
    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=None)
    names = parameter_names(unet)
    start = trained_weights(unet)
    models = TrainedModels(unet)
    optimizer = build_optimizer("adamw_schedulefree", models.parameter_groups(PEAK_RATE, {}), PEAK_RATE, 0.01, (0.9, None), 1e-8)
    models.evaluate_with(evaluation_weights_of(optimizer))  # as the trainer's build does
    ema = ShardedEMA(unet, EMA_DECAY, on_cpu=False, evaluation_weights=models.evaluation_weights)
    stepped = []  # the (clipped) gradients of every update, as the optimizer got them
    optimizer.register_step_pre_hook(lambda *_: stepped.append([local_shard(parameter.grad).clone() for parameter in unet.parameters()]))
    step = TrainStep(
        unet, optimizer, SCHEDULE, build_noise_scheduler(str(tiny_pipeline_dir), "epsilon", zero_terminal_snr=False), NoiseSettings(0.0),
        empty_prompt_for(unet), run_seed=3, max_grad_norm=1.0, ema=ema,
    )  # fmt: skip
    for update in range(UPDATES):
        assert step([synthetic_batch(unet, [update, update + 5], seed=3, height=16, width=16)], epoch=0).stepped

    # schedulefree over the same gradients and rates; its x after every update, averaged as the EMA averages.
    reference = [torch.nn.Parameter(start[name].clone()) for name in names]
    their_optimizer = AdamWScheduleFree(reference, lr=PEAK_RATE, weight_decay=0.01, warmup_steps=0)
    their_optimizer.train()
    their_ema = [weight.clone() for weight in start.values()]
    for update, gradients in enumerate(stepped):
        for parameter, gradient in zip(reference, gradients):
            parameter.grad = gradient.clone()
        their_optimizer.param_groups[0]["lr"] = SCHEDULE(update)
        their_optimizer.step()
        decay = min(EMA_DECAY, (1 + update) / (10 + update))
        for average, parameter in zip(their_ema, reference):  # x without eval(), whose in-place round trip is not exact
            average.lerp_(torch.lerp(parameter.detach(), their_optimizer.state[parameter]["z"], 1 - 1 / 0.9), 1 - decay)
    their_optimizer.eval()
    their_x = {name: parameter.detach() for name, parameter in zip(names, reference)}

    y = trained_weights(unet)
    assert all(not torch.equal(y[name], their_x[name]) for name in names if y[name].numel() > 1)  # y is not what gets evaluated
    with models.evaluation_weights_in_model():  # what validation computes its loss with
        for name, weights in trained_weights(unet).items():
            torch.testing.assert_close(weights, their_x[name], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(weights, y[name]) for name, weights in trained_weights(unet).items())  # training goes on from y, bit for bit

    settings = ExportSettings(str(tiny_pipeline_dir), None, None, {}, True, False, "fp32", "schedule_free", 0, 1)
    for with_ema in (False, True):
        pipeline_dir = tmp_path / f"pipeline_ema_{with_ema}"
        Exporter(settings, world, lambda: models.exported_weights_on_rank0(ema if with_ema else None, True), with_ema, tmp_path).export(pipeline_dir)
        exported = load_file(pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
        expected = dict(zip(names, their_ema)) if with_ema else their_x
        assert set(exported) == set(names)
        for name in names:
            torch.testing.assert_close(exported[name], expected[name], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(weights, y[name]) for name, weights in trained_weights(unet).items())


def test_the_ema_on_the_cpu_averages_the_evaluation_weights_as_on_the_device():
    """--ema_on_cpu stages each update's evaluation weights in fp32 (over bf16 weights too: x is not rounded to the
    weights' dtype) and averages them in later: bit for bit the device's average, a skipped update included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    optimizer = build_optimizer("adamw_schedulefree", model.parameters(), 1e-2, 0.0, (0.9, None), 1e-8)
    on_device, on_host = (ShardedEMA(model, 0.9, on_cpu=on_cpu, evaluation_weights=evaluation_weights_of(optimizer)) for on_cpu in (False, True))
    assert all(staged.dtype == torch.float32 for staged in on_host._staged)
    for verdict in (True, False, True, True):
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        finite = torch.tensor(verdict)
        optimizer.step(finite=finite)
        on_device.update(finite)
        on_host.update(finite)
    evaluated = optimizer.evaluation_weights(list(model.parameters()))
    assert not all(torch.equal(x, parameter.detach().float()) for x, parameter in zip(evaluated, model.parameters()))
    for name, weights in on_device.state_dict()["weights"].items():
        assert torch.equal(on_host.state_dict()["weights"][name], weights), name
