"""What makes a GPU's host wait, counted over updates of the tiny model through the trainer's own path (the data
stream with its draws, TrainStep, the monitor's logging, the ranks' stop agreement): every read of a tensor's value on the host (.item(),
.tolist(), a truth value, int() / float(), .numpy(), .cpu(), nonzero). On a GPU each read of a device tensor
stops the host until the GPU has caught up, and the GPU then idles while the host prepares what comes next.

Here everything is on the CPU, so a read is told apart by where it happens: the monitor's one read of the
figures of the updates since it last logged (UpdateResult.read_together), on updates that log and on no
other, and reads of tensors that live on the host by design (the monitor's peak-memory figures and the stop
agreement's flag, both over gloo groups), listed below with why. Any other read fails the test, with its place.
On a GPU, CUDA's sync debug mode also refuses every wait on the updates that do not log.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers import UNet2DConditionModel
from torch.overrides import TorchFunctionMode
from unet_batches import make_train_step

from sdxl_trainer.distributed.fsdp import prepare_unet
from sdxl_trainer.distributed.stop_request import StopRequest
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter
from sdxl_trainer.monitoring.monitor import TrainingMonitor
from sdxl_trainer.optimizers.build import build_optimizer
from sdxl_trainer.training.data_options import DataSettings
from sdxl_trainer.training.ema import ShardedEMA
from sdxl_trainer.training.holdout import SplitSettings
from sdxl_trainer.training.noise_settings import NoiseSettings
from sdxl_trainer.training.sample_draws import SampleDraws
from sdxl_trainer.training.stream import DataPosition
from sdxl_trainer.training.training_data import load_training_data

HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}
# Where a read is allowed: (file, function) of the code that reads.
THE_LOGS_READ = ("step.py", "read_together")  # the figures of the updates since the last log, one transfer
# Allocator peaks gathered, and the stop flag all-reduced, over gloo groups: CPU tensors, no GPU.
HOST_SIDE = {("memory_peaks.py", "gather_floats"), ("stop_request.py", "agreed")}


@contextlib.contextmanager
def no_device_syncs(device: torch.device, refused: bool) -> Iterator[None]:
    """On a GPU (the battery runs this file there: GPU_CHECK_PARTS=host_waits) with `refused`, CUDA raises at any
    operation that makes the host wait for the device, wherever it is: a read, a blocking copy, a synchronize.
    Off the GPU there is nothing to refuse; HostReads tells the reads apart by their place."""
    if device.type != "cuda" or not refused:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class HostReads(TorchFunctionMode):
    """Every host read of a tensor, by the file and function that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[tuple[str, str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            caller = sys._getframe(1)
            self.places.append((caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_code.co_name, caller.f_lineno))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow  # the first update compiles the 8-bit step (seconds to minutes on a CPU)
@pytest.mark.parametrize("optimizer_name", ["adamw8bit", "adamw"])
def test_only_updates_that_log_read_the_device_once_and_never_inside_a_microbatch(world, tiny_pipeline_dir, sample_cache_dir, tmp_path, optimizer_name):
    seed, settings, log_every = 4, NoiseSettings(conditional_dropout_percent=0.1, noise_offset=0.05, ip_noise_gamma=0.1), 3
    data = load_training_data(
        DataSettings([str(sample_cache_dir)], None, None, flip_aug=False, loss_masks=False, per_rank_batch=2, gradient_accumulation_steps=2,
                     num_epochs=4, max_updates=0, num_workers=0, split=SplitSettings(0.0, 0.0, 0, 0), captions_in_memory=False),
        tmp_path / "run", seed, world_size=1, is_main=True,
    )
    stream = data.stream(DataPosition.epoch_start(0), 0, rank=0, device=world.device, draws=SampleDraws(seed, settings))
    unet = prepare_unet(UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet"), world, param_dtype=None)
    optimizer = build_optimizer(optimizer_name, unet.parameters(), 1e-4, 1e-2, (0.9, None), 1e-8)
    step = make_train_step(unet, optimizer, tiny_pipeline_dir, settings, ema=ShardedEMA(unet, decay=0.99, on_cpu=False))
    host_group = dist.new_group(backend="gloo")  # as train_build makes it
    monitor = TrainingMonitor(MetricsWriter(tmp_path / "tensorboard", True), stream.num_updates, 0, world.device, True, host_group, every_n_updates=log_every)
    stop = StopRequest(announce=False, host_group=host_group)
    reads_per_update, results = [], []
    for number, update in zip(range(7), stream):
        assert all("noise" in batch for batch in update.microbatches)  # drawn where the batch was read
        logs = (number + 1) % log_every == 0
        with HostReads() as reads, no_device_syncs(world.device, number > 0 and not logs):
            result = step(update.microbatches, update.epoch)
            monitor.log_update(step.updates_done, update.epoch, result)
            assert not stop.agreed()
        reads_per_update.append(reads.places)
        results.append(result)
    monitor.close()
    stop.restore_handlers()
    assert len(reads_per_update) == 7
    # The first update builds the optimizer's layout from its state (the 8-bit step counts: one read, once).
    for update, places in enumerate(reads_per_update[1:], start=2):
        by_place = defaultdict(int)
        for file, function, _ in places:
            by_place[(file, function)] += 1
        unexpected = {place: count for place, count in by_place.items() if place != THE_LOGS_READ and place not in HOST_SIDE}
        assert unexpected == {}, f"update {update}: host reads outside the log's one read: {sorted(set(places))}"
        assert by_place[THE_LOGS_READ] == (1 if update % log_every == 0 else 0), f"update {update}: {sorted(set(places))}"
    # What the log read holds: every update's figures up to the last log, none after it.
    assert [result.is_read for result in results] == [True] * 6 + [False]
    assert all(result.stepped and np.isfinite(result.loss) and result.grad_norm > 0 for result in results[:6])
