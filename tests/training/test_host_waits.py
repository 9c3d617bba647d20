"""What makes a GPU's host wait, counted over the trainer's own run (its build and loop: data stream, TrainStep,
monitor, the stop agreement, garbage collection) on the tiny model: every read of a tensor's value on the host
(.item(), .tolist(), a truth value, int() / float(), .numpy(), .cpu(), nonzero) and every blocking copy of host
values to the device (torch.tensor(values, device=...)), every collective over the
trainer's gloo group of host-side values, and every Python garbage collection (estimates/host_work.py). On a
GPU each read of a device tensor stops the host until the GPU has caught up, and the GPU then idles while the
host prepares what comes next; a host collective waits for the slowest rank.

An update that does not log (--log_every_n_updates) must do none of these: no read, no host collective, no
automatic garbage collection. One that logs reads the figures of the updates since the last log in one
transfer (UpdateResult.read_together) and makes one exchange between the ranks (peak memory and the stop
flag: all_gather_floats). Here everything is on the CPU, so a read is told apart by its place. On a GPU (the
battery: GPU_CHECK_PARTS=host_waits), CUDA's sync debug mode also refuses every wait in the updates that do
not log, wherever it is.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO_ROOT, run_processes, trainer_flags
from counted_runs import CountedUpdate, count_trainer_updates

from sdxl_trainer.optimizers.build import OPTIMIZERS

THE_LOGS_READS = {"step.py:read_together": 1, "world.py:all_gather_floats": 1}  # the device's figures; the ranks' host values
# torch's loss-scale update on a CPU device, in Python (its ShardedGradScaler): on a GPU it is one kernel, no read.
CPU_DEVICE_READS = {"sharded_grad_scaler.py:_amp_update_scale_cpu_"}
LOG_EVERY, GC_EVERY, UPDATES = 3, 2, 7


def counted_run_flags(sample_cache_dir, tiny_pipeline_dir, output_dir, *extra: str) -> list[str]:
    return trainer_flags(
        sample_cache_dir, tiny_pipeline_dir, output_dir, "run", "--log_every_n_updates", str(LOG_EVERY), "--gc_every_n_updates", str(GC_EVERY),
        "--max_train_updates", str(UPDATES), "--gradient_accumulation_steps", "2", "--use_ema", "--no-validation_loss",
        "--dataloader_num_workers", "1", *extra,
    )  # fmt: skip


def assert_only_updates_that_log_wait(updates: list[CountedUpdate], processes: int = 1) -> None:
    """On one process also no collective over the training group: alone, a GPU would still launch it."""
    assert [update.update for update in updates] == list(range(2, UPDATES))
    for update in updates:
        update.reads = {place: count for place, count in update.reads.items() if place not in CPU_DEVICE_READS}
        if update.logs:
            assert update.reads == THE_LOGS_READS, f"update {update.update} logs: {update.reads}"
            assert update.host_collectives == 1, f"update {update.update} logs: {update.host_collectives} host collectives"
        else:
            assert update.reads == {}, f"update {update.update} does not log, yet reads: {update.reads}"
            assert update.host_collectives == 0, f"update {update.update} does not log, yet {update.host_collectives} host collectives"
        assert update.garbage_collections.get("automatic", 0) == 0, f"update {update.update}: {update.garbage_collections}"
        if processes == 1:
            assert update.device_collectives == 0, f"update {update.update} on one process: {update.device_collectives} collectives"
        assert update.garbage_collections.get("between updates", 0) == (1 if update.update % GC_EVERY == 0 else 0), update


@pytest.mark.slow  # a trainer run in this process each (the 8-bit step compiles on the first)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_only_updates_that_log_wait_with_every_optimizer(world, sample_cache_dir, tiny_pipeline_dir, tmp_path, optimizer):
    """Prodigy's all-reduce of its step-size sums is a collective of device values over the training group (as
    FSDP2's, as Adafactor's): queued on the GPU like them, not a host wait; one process makes none, nor the
    step's average of the loss."""
    rate = ("--learning_rate", "1.0") if optimizer == "prodigy" else ()  # Prodigy refuses AdamW's default rate
    flags = counted_run_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "--optimizer", optimizer, *rate)
    assert_only_updates_that_log_wait(count_trainer_updates(flags, world))


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    ("--ema_on_cpu",),
    ("--mixed_precision", "fp16"),
    ("--encode_captions_each_step", "--shuffle_caption"),
    ("--encode_captions_each_step", "--train_text_encoder"),
    ("--optimizer_in_backward", "--gradient_accumulation_steps", "1", "--max_grad_norm", "0"),
], ids=["ema_on_cpu", "fp16", "caption_mode", "trained_text_encoders", "optimizer_in_backward"])  # fmt: skip
def test_only_updates_that_log_wait_on_every_path(world, sample_cache_dir, tiny_pipeline_dir, tmp_path, variant):
    assert_only_updates_that_log_wait(count_trainer_updates(counted_run_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, *variant), world))


@pytest.mark.multiprocess
def test_only_updates_that_log_wait_on_two_processes(sample_cache_dir, tiny_pipeline_dir, tmp_path):
    """FSDP2 over 2 ranks: the same, on every rank (each writes its counts)."""
    flags = counted_run_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path)
    run_processes(2, REPO_ROOT / "tests" / "support" / "host_waits_worker.py", [str(tmp_path / "counts"), *flags])
    for rank in range(2):
        counted = json.loads((tmp_path / "counts" / f"rank{rank}.json").read_text())
        assert_only_updates_that_log_wait([CountedUpdate(**update) for update in counted], processes=2)


def test_a_blocking_copy_of_host_values_to_the_device_counts_as_a_wait_and_a_non_blocking_one_does_not():
    """On a GPU torch.tensor(values, device=...) copies and then waits for the device's whole queue, as a read
    does: Adafactor and CAME made such a copy of their tensors' sizes at every update. The copy that does not
    wait (host_values_to), a tensor made on the host, and torch's own Python numbers passed to compiled code
    as CPU tensors are not counted."""
    from sdxl_trainer.estimates.host_work import HostWork
    from sdxl_trainer.optimizers.shards import host_values_to

    device = torch.device("cpu")  # the training device here
    step = torch.compile(lambda values, rate: values * rate, fullgraph=True)
    step(torch.ones(2), 0.5)  # compiled before the count: its later calls pass the rate as a CPU tensor
    with HostWork(by_part=False) as counts:
        torch.tensor([1.0, 2.0], device=device)
        torch.as_tensor([3], dtype=torch.int64, device=device)
    assert counts.reads == {("test_host_waits.py", "test_a_blocking_copy_of_host_values_to_the_device_counts_as_a_wait_and_a_non_blocking_one_does_not"): 2}
    with HostWork(by_part=False) as counts:
        copied = host_values_to([1.0, 2.0], torch.float32, device)
        torch.tensor([1.0])
        torch.as_tensor(copied, device=device)
        step(copied, 0.25)
    assert counts.total_reads == 0
    assert copied.dtype == torch.float32 and copied.tolist() == [1.0, 2.0]


def test_garbage_is_collected_between_updates_on_every_rank_and_never_inside_one():
    """Python's automatic collection starts wherever allocations cross its threshold: inside an update, on each
    rank at its own moment. With the trainer's setting it is off, and the young generations are collected
    after every N updates (the same updates on every rank); 0 leaves the automatic collection as it was."""
    import gc

    from sdxl_trainer.estimates.host_work import HostWork
    from sdxl_trainer.runtime.garbage_collection import CollectBetweenUpdates

    def updates_with_cyclic_garbage(collect: CollectBetweenUpdates) -> list[dict]:
        counted = []
        for update in range(1, 5):
            with HostWork(by_part=False) as counts:
                for _ in range(5000):  # an update's Python garbage, reference cycles included
                    cycle = []
                    cycle.append(cycle)
                collect.after_update(update)
            counted.append(dict(counts.garbage_collections))
        collect.close()
        return counted

    assert gc.isenabled()
    automatic = updates_with_cyclic_garbage(CollectBetweenUpdates(0))
    assert all(counts.get("automatic", 0) > 0 for counts in automatic), automatic
    between = updates_with_cyclic_garbage(CollectBetweenUpdates(2))
    assert between == [{}, {"between updates": 1}, {}, {"between updates": 1}]
    assert gc.isenabled()  # given back


def test_the_ema_on_the_cpu_copies_the_weights_without_waiting_and_averages_as_on_the_device():
    """--ema_on_cpu: each update's weights go to the host in one non-blocking copy (into pinned buffers on a GPU
    machine) and are averaged in at the next update or when the average is read; a blocking copy of every shard
    made the host wait for each update to finish. The average is bit for bit the one kept on the device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sdxl_trainer.training.ema import ShardedEMA

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.non_blocking, self.moved_blocking = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._foreach_copy_.default and kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                self.non_blocking += 1
            if func is torch.ops.aten._to_copy.default and "device" in kwargs and not kwargs.get("non_blocking", False):
                self.moved_blocking += 1
            return func(*args, **kwargs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    on_device, on_host = ShardedEMA(model, 0.9, on_cpu=False), ShardedEMA(model, 0.9, on_cpu=True)
    verdicts = [True, False, True, True]
    for verdict in verdicts:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        finite = torch.tensor(verdict)
        on_device.update(finite)
        with Copies() as copies:
            on_host.update(finite)
        assert (copies.non_blocking, copies.moved_blocking) == (1, 0)
    assert on_host.updates == on_device.updates == len(verdicts)
    for name, weights in on_device.state_dict()["weights"].items():
        assert torch.equal(on_host.state_dict()["weights"][name], weights), name
