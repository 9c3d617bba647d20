"""The update and the objective on the tiny UNet, in this process (a 1-process gloo group; the UNet
FSDP2-sharded as on several processes, or plain as the trainer keeps it on one): the two layouts train
alike, micro-conditioning, caption dropout, accumulation, clipping, NaN/inf skipping, the
prediction targets, Min-SNR, noise offset, timestep range, zero terminal SNR, EMA and regional compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from unet_batches import assert_clipped_as_torch, clipping_against_torch, empty_prompt_for, make_train_step, synthetic_batch

from sdxl_trainer.cache.reader import load_manifest
from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.fsdp import compile_repeated_blocks, compute_under_autocast, parameter_names, prepare_unet, recompile_limit_for, shard_unet
from sdxl_trainer.models.sdxl import build_full_size_unet
from sdxl_trainer.optimizers.build import OPTIMIZERS, build_optimizer
from sdxl_trainer.training.dataset import CachedDataset, collate
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.loss import build_noise_scheduler, min_snr_weights, signal_to_noise, training_loss
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import draw_sample_randomness


def sharded_unet(pipeline_dir, world, compile_blocks: bool = False, param_dtype: torch.dtype | None = None, cpu_offload: bool = False):
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    shard_unet(unet, world.mesh, param_dtype=param_dtype, compile_blocks=compile_blocks, cpu_offload=cpu_offload)
    return unet


def scaler_for(layout: str, init_scale: float) -> torch.amp.GradScaler:
    """fp16's loss scaler as the trainer builds it for the layout (train_build.loss_scaler): the sharded one for FSDP2."""
    return (ShardedGradScaler if layout == "fsdp2" else torch.amp.GradScaler)("cpu", init_scale=init_scale)


def unet_in_layout(layout: str, pipeline_dir, world, param_dtype: torch.dtype | None = None):
    """"fsdp2": sharded as on several processes; "plain": what prepare_unet gives one process."""
    if layout == "fsdp2":
        return sharded_unet(pipeline_dir, world, param_dtype=param_dtype)
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    prepare_unet(unet, world, param_dtype)
    assert not isinstance(unet.conv_in.weight, DTensor)
    return unet


LAYOUTS = ("fsdp2", "plain")


def weights(unet) -> dict[str, torch.Tensor]:
    return {name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()).clone() for name, parameter in unet.named_parameters()}


def largest_difference(first: dict, second: dict) -> float:
    return max((first[key] - second[key]).abs().max().item() for key in first)


class ZeroUNet(torch.nn.Module):
    """Predicts 0 everywhere, so the loss is the mean square of the target."""

    def forward(self, sample, timestep, encoder_hidden_states, added_cond_kwargs):
        return type("Output", (), {"sample": torch.zeros_like(sample)})


# --- what reaches the UNet ------------------------------------------------------------------------------


def captured_unet_inputs(unet, run):
    """Run `run()` and return what the UNet got: time ids (as its add_time_proj sees them), caption
    embeddings and pooled embeddings."""
    seen = {}

    def on_time_ids(module, args):
        seen["time_ids"] = args[0].detach().clone()

    def on_forward(module, args, kwargs):
        seen["encoder_hidden_states"] = kwargs["encoder_hidden_states"].detach().clone()
        seen["text_embeds"] = kwargs["added_cond_kwargs"]["text_embeds"].detach().clone()

    handles = [unet.add_time_proj.register_forward_pre_hook(on_time_ids), unet.register_forward_pre_hook(on_forward, with_kwargs=True)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_micro_conditioning_of_every_sample_reaches_the_unet(world, tiny_pipeline_dir, sample_cache_dir, batch_size):
    dataset = CachedDataset([sample_cache_dir])
    bucket_ids = dataset.bucket_ids()
    largest_bucket = np.bincount(np.unique(bucket_ids, return_inverse=True)[1]).argmax()
    items = np.flatnonzero(np.unique(bucket_ids, return_inverse=True)[1] == largest_bucket)[:batch_size]
    assert len(items) == batch_size
    batch = collate([dataset[int(item)] for item in items])
    unet = sharded_unet(tiny_pipeline_dir, world)
    noise_scheduler = build_noise_scheduler(str(tiny_pipeline_dir), "epsilon", zero_terminal_snr=False)
    seen = captured_unet_inputs(
        unet, lambda: training_loss(unet, batch, noise_scheduler, empty_prompt_for(unet), 1, 0, NoiseSettings(0.0))
    )
    manifest = load_manifest(sample_cache_dir)
    columns = ("original_height", "original_width", "crop_top", "crop_left", "bucket_height", "bucket_width")
    expected = np.stack([manifest.column(name).to_numpy()[items] for name in columns], axis=1).astype(np.float32)
    assert seen["time_ids"].shape == (batch_size * 6,)
    assert torch.equal(seen["time_ids"].view(batch_size, 6).float(), torch.from_numpy(expected))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sizes_reach_the_unet_exactly_under_bf16_compute(world, tiny_pipeline_dir, layout):
    """FSDP2's mixed precision casts floating-point forward inputs to bf16, which has 8 significant bits:
    an original height of 3000 px arrived as 3008, 1023 as 1024."""
    unet = unet_in_layout(layout, tiny_pipeline_dir, world, param_dtype=torch.bfloat16)
    batch = synthetic_batch(unet, [0], seed=2)
    sizes = [3000, 1023, 17, 5, 1024, 1024]
    batch["time_ids"] = torch.tensor([sizes], dtype=torch.float32)
    assert torch.tensor(sizes, dtype=torch.bfloat16).tolist() != sizes  # what a cast would have done
    noise_scheduler = build_noise_scheduler(str(tiny_pipeline_dir), "epsilon", zero_terminal_snr=False)
    projection_input = {}
    unet.add_embedding.linear_1.register_forward_hook(lambda module, args, output: projection_input.update(dtype=output.dtype))
    seen = captured_unet_inputs(unet, lambda: training_loss(unet, batch, noise_scheduler, empty_prompt_for(unet), 1, 0, NoiseSettings(0.0)))
    assert seen["time_ids"].tolist() == sizes
    assert projection_input["dtype"] == torch.bfloat16  # the rest is computed in bf16 as before


@pytest.mark.parametrize("dropout", [0.0, 0.5, 1.0])
def test_conditional_dropout_swaps_in_the_empty_prompt_and_its_pooled_embedding(world, tiny_pipeline_dir, dropout):
    unet = sharded_unet(tiny_pipeline_dir, world)
    items = list(range(8))
    batch = synthetic_batch(unet, items, seed=5)
    empty_embeds, empty_pooled = empty_prompt_for(unet)
    noise_scheduler = build_noise_scheduler(str(tiny_pipeline_dir), "epsilon", zero_terminal_snr=False)
    settings = NoiseSettings(conditional_dropout_percent=dropout)
    seen = captured_unet_inputs(unet, lambda: training_loss(unet, batch, noise_scheduler, (empty_embeds, empty_pooled), 1, 0, settings))
    dropped = draw_sample_randomness(batch["latents"], batch["sample_index"], 1, 0, settings).drop_caption
    assert dropped.sum().item() == {0.0: 0, 1.0: 8}.get(dropout, dropped.sum().item())
    if dropout == 0.5:
        assert 0 < dropped.sum().item() < 8, "this seed should drop some captions and keep others"
    for row in range(8):
        if dropped[row]:
            assert torch.equal(seen["encoder_hidden_states"][row], empty_embeds)
            assert torch.equal(seen["text_embeds"][row], empty_pooled)
        else:
            assert torch.equal(seen["encoder_hidden_states"][row], batch["prompt_embeds"][row])
            assert torch.equal(seen["text_embeds"][row], batch["pooled_prompt_embeds"][row])


# --- the update -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulated_microbatches_equal_one_large_batch(world, tiny_pipeline_dir, layout):
    """SGD at lr 1 moves the weights by exactly the (clipped) gradient, so equal weights mean equal
    gradients. (Adam's first step is about lr * sign(gradient), which turns fp32 rounding of near-zero
    gradients into lr-sized differences, so it cannot show this.)"""
    results = {}
    for name, split in (("one batch of 4", [[0, 1, 2, 3]]), ("2 microbatches of 2", [[0, 1], [2, 3]])):
        unet = unet_in_layout(layout, tiny_pipeline_dir, world)
        optimizer = torch.optim.SGD(unet.parameters(), lr=1.0)
        step = make_train_step(unet, optimizer, tiny_pipeline_dir, NoiseSettings(0.5))
        template = synthetic_batch(unet, [0, 1, 2, 3], seed=2)
        result = step([{key: value[items] for key, value in template.items()} for items in split], epoch=0)
        results[name] = (weights(unet), result)
    (one, one_result), (two, two_result) = results.values()
    assert abs(one_result.loss - two_result.loss) < 1e-6
    assert abs(one_result.grad_norm - two_result.grad_norm) < 1e-5 * one_result.grad_norm
    assert largest_difference(one, two) < 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_scale", [None, 1024.0])
def test_clipping_bounds_the_true_gradient(world, tiny_pipeline_dir, loss_scale, layout):
    """With plain SGD at lr 1, the weights move by exactly the clipped gradient: its norm must be
    max_grad_norm, also when the loss is scaled (the scaler unscales before clipping)."""
    unet = unet_in_layout(layout, tiny_pipeline_dir, world)
    before = weights(unet)
    optimizer = torch.optim.SGD(unet.parameters(), lr=1.0)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir, max_grad_norm=1e-3)
    if loss_scale:
        step.scaler = scaler_for(layout, loss_scale)
    result = step([synthetic_batch(unet, [0, 1], seed=4)], epoch=0)
    after = weights(unet)
    moved = torch.sqrt(sum(((after[key] - before[key]) ** 2).sum() for key in before)).item()
    assert result.stepped and result.grad_norm > 1e-2  # the true norm, far above the clip
    assert moved == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_on_local_shards_gives_torchs_norm_and_gradients(world, tiny_pipeline_dir, layout):
    assert_clipped_as_torch(clipping_against_torch(unet_in_layout(layout, tiny_pipeline_dir, world)))


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every tensor the optimizer keeps (local shards; an 8-bit moment's codes and scales)."""
    copies = []
    for state in optimizer.state.values():
        for value in state.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            inner = [getattr(local, name) for name in local.__tensor_flatten__()[0]] if type(local) is not torch.Tensor else [local]
            copies += [tensor.clone() for tensor in inner]
    return copies


# Every optimizer is told the verdict on the device (nothing read on the host) and leaves everything as it was.
@pytest.mark.parametrize("optimizer_name", [pytest.param("adamw8bit", marks=pytest.mark.slow), "adamw", "lion", "adafactor", "came", "prodigy", "adamw_schedulefree"])
def test_nonfinite_update_is_skipped_without_touching_weights_or_state_but_counts_toward_the_schedule(world, tiny_pipeline_dir, optimizer_name):
    unet = sharded_unet(tiny_pipeline_dir, world)
    optimizer = build_optimizer(optimizer_name, unet.parameters(), 1e-3, 1e-2, (0.9, None), 1e-8)
    ema = ShardedEMA(unet, decay=0.9, on_cpu=False)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir, ema=ema)
    assert step.skips_on_device  # every optimizer of build_optimizer takes the verdict on the device
    assert step([synthetic_batch(unet, [0, 1], seed=3)], epoch=0).stepped  # the optimizer's state and the EMA move
    before, state_before, ema_before = weights(unet), optimizer_state(optimizer), [shadow.clone() for shadow in ema.shadow]
    poisoned = synthetic_batch(unet, [0, 1], seed=4)
    poisoned["latents"][1, 0, 0, 0] = float("nan")
    result = step([poisoned], epoch=0)
    assert not result.stepped and np.isnan(result.loss)
    assert largest_difference(before, weights(unet)) == 0.0
    state_after = optimizer_state(optimizer)
    assert len(state_after) == len(state_before) and all(torch.equal(a, b) for a, b in zip(state_before, state_after))  # moments and step counts
    assert all(torch.equal(a, b) for a, b in zip(ema_before, ema.shadow))
    assert step.updates_done == 2 and ema.updates == 2  # its batches are spent: the schedule (and the EMA's warm-up) moves on
    assert (result.skipped_updates, result.skipped_in_a_row) == (step.skipped_updates, step.consecutive_skipped_updates) == (1, 1)
    assert all(parameter.grad is None for parameter in unet.parameters())  # nothing left to leak into the next update

    result = step([synthetic_batch(unet, [0, 1], seed=4)], epoch=0)
    assert result.stepped
    assert largest_difference(before, weights(unet)) > 0
    assert not all(torch.equal(a, b) for a, b in zip(state_before, optimizer_state(optimizer)))
    assert step.updates_done == 3
    assert (result.skipped_updates, result.skipped_in_a_row) == (step.skipped_updates, step.consecutive_skipped_updates) == (1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16_scaler_overflow_lowers_the_scale_and_skips_the_step(world, tiny_pipeline_dir, layout, optimizer_name):
    """Also with --optimizer adamw as an fp16 run builds it, which takes the update's verdict on the device (the
    scaler's overflow makes the unscaled gradients' norm non-finite); SGD, a torch optimizer, is stepped through
    the scaler."""
    unet = unet_in_layout(layout, tiny_pipeline_dir, world, param_dtype=torch.float16)
    before = weights(unet)
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(unet.parameters(), lr=1e-3)
    else:
        optimizer = build_optimizer(optimizer_name, unet.parameters(), 1e-3, 1e-2, (0.9, None), 1e-8)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir)
    step.scaler = scaler_for(layout, 2.0**40)  # fp16 backward overflows at 65504
    result = step([synthetic_batch(unet, [0, 1], seed=4)], epoch=0)
    assert not result.stepped and np.isfinite(result.loss)
    assert step.scaler.get_scale() == 2.0**39
    assert step.updates_done == 1
    assert largest_difference(before, weights(unet)) == 0.0
    step.scaler = scaler_for(layout, 2.0**8)
    assert step([synthetic_batch(unet, [0, 1], seed=4)], epoch=0).stepped
    assert step.updates_done == 2


# --- the objective --------------------------------------------------------------------------------------


def test_epsilon_and_v_prediction_targets(tiny_pipeline_dir):
    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    batch = {
        "latents": latents,
        "sample_index": torch.tensor([4, 5, 6]),
        "prompt_embeds": torch.zeros(3, 77, 32),
        "pooled_prompt_embeds": torch.zeros(3, 32),
        "time_ids": torch.zeros(3, 6),
    }
    empty = (torch.zeros(77, 32), torch.zeros(32))
    settings = NoiseSettings(0.0)
    randomness = draw_sample_randomness(latents, batch["sample_index"], 9, 2, settings)
    for prediction_type in ("epsilon", "v_prediction"):
        scheduler = build_noise_scheduler(str(tiny_pipeline_dir), prediction_type, zero_terminal_snr=False)
        alpha_bar = scheduler.alphas_cumprod[randomness.timesteps].view(-1, 1, 1, 1)
        if prediction_type == "epsilon":
            target = randomness.noise
        else:  # v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0
            target = alpha_bar.sqrt() * randomness.noise - (1 - alpha_bar).sqrt() * latents
        loss = training_loss(ZeroUNet(), batch, scheduler, empty, 9, 2, settings)
        assert loss.item() == pytest.approx(target.square().mean().item(), rel=1e-5)

        gamma = 5.0
        weighted = training_loss(ZeroUNet(), batch, scheduler, empty, 9, 2, NoiseSettings(0.0, min_snr_gamma=gamma))
        snr = alpha_bar.flatten() / (1 - alpha_bar.flatten())
        weight = torch.clamp(snr, max=gamma) / (snr + 1 if prediction_type == "v_prediction" else snr)
        expected = (target.square().mean(dim=(1, 2, 3)) * weight).mean()
        assert weighted.item() == pytest.approx(expected.item(), rel=1e-5)


def test_min_snr_weights_by_hand():
    snr = torch.tensor([0.5, 5.0, 20.0])
    assert torch.allclose(min_snr_weights(snr, 5.0, "epsilon"), torch.tensor([1.0, 1.0, 0.25]))
    assert torch.allclose(min_snr_weights(snr, 5.0, "v_prediction"), torch.tensor([0.5 / 1.5, 5 / 6, 5 / 21]))


def test_zero_terminal_snr_schedule_and_finite_v_weights(tiny_pipeline_dir):
    scheduler = build_noise_scheduler(str(tiny_pipeline_dir), "v_prediction", zero_terminal_snr=True)
    plain = build_noise_scheduler(str(tiny_pipeline_dir), "v_prediction", zero_terminal_snr=False)
    assert scheduler.alphas_cumprod[-1].item() < 1e-6 < plain.alphas_cumprod[-1].item()
    snr = signal_to_noise(scheduler, torch.tensor([0, 500, 999]))
    assert snr[-1].item() < 1e-6
    assert torch.isfinite(min_snr_weights(snr, 5.0, "v_prediction")).all()


def test_noise_offset_shifts_each_channel_by_a_per_sample_constant():
    latents = torch.zeros(4, 4, 16, 16)
    items = torch.tensor([0, 1, 2, 3])
    plain = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0))
    offset = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0, noise_offset=0.1))
    shift = offset.noise - plain.noise
    per_channel = shift.mean(dim=(2, 3), keepdim=True)
    assert torch.allclose(shift, per_channel.expand_as(shift), atol=1e-6)  # constant over each channel
    assert 0 < per_channel.abs().mean().item() < 0.5
    assert torch.equal(offset.timesteps, plain.timesteps) and torch.equal(offset.drop_caption, plain.drop_caption)
    again = draw_sample_randomness(latents, items, 1, 0, NoiseSettings(0.0, noise_offset=0.1))
    assert torch.equal(offset.noise, again.noise)


def test_timesteps_stay_in_the_requested_range():
    latents = torch.zeros(200, 4, 2, 2)
    drawn = draw_sample_randomness(latents, torch.arange(200), 1, 0, NoiseSettings(0.0, min_timestep=200, max_timestep=300)).timesteps
    assert drawn.min().item() >= 200 and drawn.max().item() < 300
    assert len(torch.unique(drawn)) > 50


# --- EMA and compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_cpu", [False, True])
def test_ema_follows_the_warmed_up_decay_and_gathers_in_full(world, tiny_pipeline_dir, on_cpu):
    unet = sharded_unet(tiny_pipeline_dir, world)
    start = weights(unet)
    ema = ShardedEMA(unet, decay=0.5, on_cpu=on_cpu)
    optimizer = torch.optim.SGD(unet.parameters(), lr=0.1)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir, ema=ema)
    expected = dict(start)
    for update in range(3):
        step([synthetic_batch(unet, [update], seed=6)], epoch=0)
        decay = min(0.5, (1 + update) / (10 + update))  # 0.1, 0.18..., 0.25
        current = weights(unet)
        expected = {key: decay * expected[key] + (1 - decay) * current[key] for key in expected}
    gathered = ema.full_state_dict_on_rank0(is_main=True)
    assert gathered.keys() == expected.keys()
    assert largest_difference(gathered, expected) < 1e-6
    assert largest_difference(gathered, weights(unet)) > 1e-5  # an average, not the live weights
    assert all(shadow.device.type == "cpu" for shadow in ema.shadow)


@pytest.mark.slow
def test_regional_compile_gives_the_eager_loss(world, tiny_pipeline_dir):
    batch = synthetic_batch(UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet"), [0, 1], seed=8)
    losses = []
    for compile_blocks in (False, True):
        unet = sharded_unet(tiny_pipeline_dir, world, compile_blocks=compile_blocks)
        optimizer = torch.optim.SGD(unet.parameters(), lr=1e-2)
        step = make_train_step(unet, optimizer, tiny_pipeline_dir)
        losses.append([step([batch], epoch=0).loss for _ in range(2)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert losses[0][1] != losses[0][0]  # the second update saw the first one's weights


def test_regional_compile_keeps_a_graph_for_every_sdxl_block_shape():
    """Dynamo's default of 8 graphs per forward left 4 of SDXL's 12 ResNet block shapes running eagerly; behind the
    one checkpoint wrapper (gradient checkpointing) the 12 ResNet and 2 transformer shapes share a forward. Each
    compile gets its own limit; Dynamo's global setting (per thread) is left alone."""
    with torch.device("meta"):
        unet = build_full_size_unet()
    names = [name for name, _ in unet.named_parameters()]
    blocks = [module for module in unet.modules() if isinstance(module, (ResnetBlock2D, BasicTransformerBlock))]
    assert recompile_limit_for(blocks) == 2 * 12  # a static and a dynamic-size graph per ResNet shape
    wrapped = [checkpoint_wrapper(block) for block in blocks]
    assert recompile_limit_for(wrapped) == 2 * 14
    with torch._dynamo.config.patch(recompile_limit=8):  # restored afterwards (pytest's monkeypatch would delete it)
        unet.enable_gradient_checkpointing()
        compile_repeated_blocks(unet)
        assert torch._dynamo.config.recompile_limit == 8
    assert not unet.is_gradient_checkpointing  # the checkpoint sits inside each compiled block instead
    assert sum(isinstance(module, CheckpointWrapper) for module in unet.modules()) == len(blocks)
    assert parameter_names(unet) == names  # as the state dict, the EMA and checkpoints name them


# --- configuration --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--zero_terminal_snr"], "--zero_terminal_snr needs --prediction_type v_prediction"),
        (["--min_timestep", "500", "--max_timestep", "400"], "need 0 <= --min_timestep < --max_timestep <= 1000"),
        (["--ema_decay", "1.5"], "--ema_decay must be between 0 and 1"),
        (["--max_consecutive_skipped_updates", "0"], "--max_consecutive_skipped_updates must be at least 1"),
    ],
)
def test_train_config_rejects_inconsistent_objective_options(flags, message, capsys):
    from sdxl_trainer.jobs.train_config import TrainConfig

    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", *flags])
    assert message in capsys.readouterr().err


def test_train_config_accepts_v_prediction_with_zero_terminal_snr():
    from sdxl_trainer.jobs.train_config import TrainConfig

    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--prediction_type", "v_prediction", "--zero_terminal_snr", "--optimizer", "lion"])
    assert (config.prediction_type, config.zero_terminal_snr, config.optimizer) == ("v_prediction", True, "lion")


@pytest.mark.parametrize("optimizer,beta2", [("lion", 0.99), ("adamw", 0.999), ("adamw8bit", 0.999)])
def test_beta2_defaults_to_each_optimizers_own(optimizer, beta2):
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.optimizers.build import build_optimizer

    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", optimizer])
    built = build_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(4))], 1e-4, 0.0, (config.adam_beta1, config.adam_beta2), 1e-8)
    assert built.param_groups[0]["betas"] == (0.9, beta2)
    explicit = build_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(4))], 1e-4, 0.0, (0.9, 0.95), 1e-8)
    assert explicit.param_groups[0]["betas"] == (0.9, 0.95)


def test_came_takes_the_adam_betas_and_its_own_third():
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.optimizers.build import build_optimizer

    parameters = [torch.nn.Parameter(torch.zeros(4))]
    assert build_optimizer("came", parameters, 1e-4, 0.0, (0.9, None), 1e-8).param_groups[0]["betas"] == (0.9, 0.999, 0.9999)  # the paper's
    config = parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--optimizer", "came", "--adam_beta2", "0.99", "--came_beta3", "0.999"])
    built = build_optimizer("came", parameters, 1e-4, 0.0, (config.adam_beta1, config.adam_beta2), 1e-8, came_beta3=config.came_beta3)
    assert built.param_groups[0]["betas"] == (0.9, 0.99, 0.999)


def test_no_two_samples_share_their_noise_across_epochs_and_items():
    """torch's CPU generator keeps 32 bits of a seed; with the old linear seed, item i+2 in epoch e+2 drew
    exactly item i's noise of epoch e."""
    latents = torch.zeros(1, 4, 4, 4)
    first_values = {}
    for epoch in range(12):
        for item in range(40):
            noise = draw_sample_randomness(latents, torch.tensor([item]), 7, epoch, NoiseSettings(0.1)).noise
            first_values[(epoch, item)] = tuple(noise.flatten()[:4].tolist())
    assert first_values[(0, 0)] != first_values[(2, 2)]
    assert len(set(first_values.values())) == len(first_values)
    again = draw_sample_randomness(latents, torch.tensor([5]), 7, 3, NoiseSettings(0.1)).noise
    assert tuple(again.flatten()[:4].tolist()) == first_values[(3, 5)]  # reproducible


def test_validation_loss_can_score_the_ema_weights_and_the_trained_ones_come_back(world, tiny_pipeline_dir, sample_cache_dir):
    """With --use_ema the exported weights are the EMA's, so that is what val/loss must measure."""
    from sdxl_trainer.evaluation.validation import validation_loss
    from sdxl_trainer.training.dataset import CachedDataset

    unet = sharded_unet(tiny_pipeline_dir, world)
    ema = ShardedEMA(unet, decay=0.5, on_cpu=True)
    step = make_train_step(unet, torch.optim.SGD(unet.parameters(), lr=0.5), tiny_pipeline_dir, ema=ema)
    for update in range(2):
        step([synthetic_batch(unet, [update], seed=6)], epoch=0)
    trained = weights(unet)
    dataset = CachedDataset([sample_cache_dir])
    scheduler = step.noise_scheduler

    def loss() -> float:
        return validation_loss(unet, dataset, np.arange(6), scheduler, seed=1, device=torch.device("cpu"))["val/loss"]

    raw = loss()
    with ema.weights_in_model():
        assert largest_difference(weights(unet), ema.full_state_dict_on_rank0(is_main=True)) == 0.0
        of_ema = loss()
    assert largest_difference(weights(unet), trained) == 0.0  # bit for bit
    assert of_ema != raw and loss() == raw


def test_cpu_offload_trains_exactly_like_keeping_everything_on_the_device(world, tiny_pipeline_dir):
    """On a GPU the offloaded shards live in CPU memory; here (CPU) the same FSDP2 code path runs and must
    give the same update."""
    results = []
    for offload in (False, True):
        unet = sharded_unet(tiny_pipeline_dir, world, cpu_offload=offload)
        step = make_train_step(unet, torch.optim.AdamW(unet.parameters(), lr=1e-3), tiny_pipeline_dir)
        for update in range(2):
            step([synthetic_batch(unet, [update, update + 5], seed=3)], epoch=0)
        results.append(weights(unet))
    assert largest_difference(*results) == 0.0


# --- one process: a plain UNet ---------------------------------------------------------------------------

LEARNING_RATE = 1e-3


def three_updates(unet, optimizer_name: str, pipeline_dir, stepped_gradients: list | None = None) -> tuple[dict[str, torch.Tensor], list, list]:
    """Three updates of 2 microbatches (3 items) with clipping and EMA: the weights, each UpdateResult and
    the (clipped) gradients each update stepped with. With `stepped_gradients` (another run's), every update
    steps with those instead of its own, so the two runs start every update from the same weights."""
    optimizer = build_optimizer(optimizer_name, unet.parameters(), LEARNING_RATE, 1e-2, (0.9, None), 1e-8)
    parameters = list(unet.parameters())
    stepped = []

    def record_or_replace(optimizer, args, kwargs) -> None:
        local_grads = [parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad for parameter in parameters]
        if stepped_gradients is not None:
            torch._foreach_copy_(local_grads, stepped_gradients[len(stepped)])
        stepped.append([grad.clone() for grad in local_grads])

    optimizer.register_step_pre_hook(record_or_replace)
    step = make_train_step(unet, optimizer, pipeline_dir, NoiseSettings(0.3), ema=ShardedEMA(unet, decay=0.9, on_cpu=False))
    results = [step([synthetic_batch(unet, [u, u + 5], seed=3), synthetic_batch(unet, [u + 10], seed=3)], epoch=0) for u in range(3)]
    return weights(unet), results, stepped


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_one_process_trains_a_plain_unet_like_the_sharded_one(world, tiny_pipeline_dir, optimizer_name):
    """prepare_unet leaves the UNet unsharded on one process. Its losses and gradient norms are the sharded
    UNet's to fp32 rounding (the layouts round some gradients an ulp apart), and the optimizer steps its
    plain tensors exactly as the shards. The plain run steps with the sharded run's gradients: left to
    their own gradients, the runs' ulps can compound through the optimizer: on CI's machine (not on this
    one) their adamw8bit losses came 1e-3 apart within three updates (2026-11-27)."""
    sharded_weights, sharded, stepped_gradients = three_updates(sharded_unet(tiny_pipeline_dir, world), optimizer_name, tiny_pipeline_dir)
    plain_weights, plain, _ = three_updates(unet_in_layout("plain", tiny_pipeline_dir, world), optimizer_name, tiny_pipeline_dir, stepped_gradients)
    for a, b in zip(sharded, plain):
        assert a.stepped and b.stepped
        assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
    assert largest_difference(sharded_weights, plain_weights) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_a_plain_unet_resumes_exactly(world, tiny_pipeline_dir, tmp_path, optimizer_name):
    """One process: "2 updates straight" equals "1 update, save, restore into a fresh UNet and optimizer,
    1 update", bit for bit, for every optimizer (torchao's 8-bit state included)."""
    from unet_batches import save_training_state, saved_state_of

    from sdxl_trainer.state.load import load_training_state

    def fresh():
        unet = unet_in_layout("plain", tiny_pipeline_dir, world)
        optimizer = build_optimizer(optimizer_name, unet.parameters(), LEARNING_RATE, 1e-2, (0.9, None), 1e-8)
        ema = ShardedEMA(unet, decay=0.9, on_cpu=False)
        return unet, optimizer, ema, make_train_step(unet, optimizer, tiny_pipeline_dir, ema=ema)

    unet, optimizer, ema, step = fresh()
    step([synthetic_batch(unet, [0, 1], seed=3)], epoch=0)
    save_training_state(tmp_path / "checkpoint", unet, optimizer, ema, *saved_state_of(step, optimizer_name, 1))
    straight_loss = step([synthetic_batch(unet, [2, 3], seed=3)], epoch=0).loss
    straight, straight_ema = weights(unet), ema.full_state_dict_on_rank0(True)

    unet, optimizer, ema, step = fresh()
    load_training_state(tmp_path / "checkpoint", unet, optimizer, ema)
    assert step([synthetic_batch(unet, [2, 3], seed=3)], epoch=0).loss == straight_loss
    assert largest_difference(straight, weights(unet)) == 0.0
    assert largest_difference(straight_ema, ema.full_state_dict_on_rank0(True)) == 0.0


def test_autocast_is_left_after_the_forward_also_when_it_raises():
    seen = []

    class Failing(torch.nn.Module):
        def forward(self, x, fail):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            if fail:
                raise ValueError("broken batch")
            return torch.nn.functional.linear(x, torch.ones(2, 2))

    module = Failing()
    compute_under_autocast(module, "cpu", torch.bfloat16)
    assert module(torch.ones(1, 2), False).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="broken batch"):
        module(torch.ones(1, 2), True)
    assert seen == [(True, torch.bfloat16)] * 2
    assert not torch.is_autocast_enabled("cpu")
    assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(2, 2)).dtype == torch.float32


def test_whether_a_save_is_due_is_decided_without_the_steps_state(world, tmp_path):
    """After every update the checkpointer asks whether a save is due. It reads the step's update count, not its
    state_dict(), which reads the fp16 loss scaler's scale and growth tracker from the device (a GPU sync after
    every update); state_dict() is for the save itself."""
    from sdxl_trainer.state.checkpointer import Checkpointer, CheckpointOptions, RunFacts
    from sdxl_trainer.training.stream import DataPosition

    class Step:
        updates_done = 3

        def state_dict(self) -> dict:
            raise AssertionError("the step's state read to decide whether to save")

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("not resumed here")

    model = torch.nn.Linear(2, 2)
    checkpointer = Checkpointer(
        tmp_path / "checkpoints", CheckpointOptions(save_state=True, save_state_every_n_updates=2, checkpoints_total_limit=0), model,
        torch.optim.SGD(model.parameters(), lr=0.1), None, Step(), RunFacts("adamw", "fp32", False, False, "", 2, 1), seed=0, report=print,
        last_saved_update=None,
    )  # fmt: skip
    checkpointer.after_update(DataPosition.epoch_start(0))  # update 3 of every 2: nothing due
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["full_shard", "shard_grad_op"])
def test_a_validation_between_updates_with_the_ema_weights_leaves_the_next_update_as_it_was(world, tiny_pipeline_dir, sample_cache_dir,
                                                                                            reshard_after_forward):
    """A forward without backward (validation) leaves what FSDP2 keeps gathered after a forward (the root; every
    unit without reshard_after_forward) gathered, and the EMA's swap changes the shards under it: the next update
    must still compute with the trained weights, bit for bit as without the validation."""
    from sdxl_trainer.evaluation.validation import validation_loss
    from sdxl_trainer.training.dataset import CachedDataset

    trained = []
    for validate in (False, True):
        unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet")
        shard_unet(unet, world.mesh, param_dtype=None, reshard_after_forward=reshard_after_forward)
        ema = ShardedEMA(unet, decay=0.5, on_cpu=False)
        step = make_train_step(unet, torch.optim.SGD(unet.parameters(), lr=0.5), tiny_pipeline_dir, ema=ema)
        step([synthetic_batch(unet, [0], seed=6)], epoch=0)
        if validate:
            with ema.weights_in_model():
                validation_loss(unet, CachedDataset([sample_cache_dir]), np.arange(2), step.noise_scheduler, seed=1, device=torch.device("cpu"))
        step([synthetic_batch(unet, [1], seed=6)], epoch=0)
        trained.append(weights(unet))
    assert largest_difference(*trained) == 0.0
