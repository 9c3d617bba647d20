"""The trainer's own build and loop (sdxl_FSDP_train.py's) in this process, every update's host work counted
(estimates/host_work.py): for the tests of what the host waits for (test_host_waits.py and its 2-process
worker)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdxl_trainer.config import parse_config
from sdxl_trainer.distributed.stop_request import StopRequest
from sdxl_trainer.distributed.world import World
from sdxl_trainer.estimates.host_work import CountedEveryUpdate
from sdxl_trainer.jobs.train_build import build_run
from sdxl_trainer.jobs.train_config import TrainConfig
from sdxl_trainer.jobs.train_loop import run_loop


@dataclass
class CountedUpdate:
    update: int
    logs: bool  # writes the scalars (every --log_every_n_updates)
    reads: dict[str, int]  # host reads by "file:function"
    host_collectives: int  # calls over the trainer's gloo group of host-side values
    device_collectives: int  # calls over the other groups (the training group's, FSDP2's): values on the device
    garbage_collections: dict[str, int]  # "automatic" / "between updates" -> how many


class _SyncsRefusedOnUpdatesThatDoNotLog(CountedEveryUpdate):
    """On a GPU, CUDA's sync debug mode raises at any read, blocking copy or synchronize in the stretch of an
    update that does not log (from its step to the next): the GPU battery's check that the host never waited."""

    def __init__(self, step, every_n_updates: int):
        super().__init__(step, by_part=False)
        self.every_n_updates = every_n_updates

    def __call__(self, microbatches, epoch):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        result = super().__call__(microbatches, epoch)
        update = self.step.updates_done
        if torch.cuda.is_available() and update > 1 and update % self.every_n_updates:
            torch.cuda.set_sync_debug_mode("error")
        return result


def count_trainer_updates(flags: list[str], world: World) -> list[CountedUpdate]:
    """Train with `flags` (a full trainer command line), counting each update from its step to the next; the
    first update (which makes the optimizer's state and compiles) and the last (the run's end) are left out."""
    config = parse_config(TrainConfig, flags)
    run = build_run(config, world, StopRequest(announce=False))
    counted = _SyncsRefusedOnUpdatesThatDoNotLog(run.train_step, config.log_every_n_updates)
    run.train_step = counted
    try:
        run_loop(run)
    finally:
        counted.close()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        run.close()
    host_group = run.monitor.host_group.group_name
    return [
        CountedUpdate(
            update=number,
            logs=number % config.log_every_n_updates == 0,
            reads={f"{file}:{function}": count for (file, function), count in counts.reads.items()},
            host_collectives=sum(count for (_, group), count in counts.collective_calls.items() if group == host_group),
            device_collectives=sum(count for (_, group), count in counts.collective_calls.items() if group != host_group),
            garbage_collections=dict(counts.garbage_collections),
        )
        for number, counts in enumerate(counted.updates[1:-1], start=2)
    ]
