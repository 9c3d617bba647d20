"""The background save's writer process (state/writer_process.py): it writes what the training process would
have written itself, reports a failed save and goes on, outlives the job's Ctrl-C and SIGTERM (its training
process decides), and dies with its training process."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import DISTRIBUTED_ENV, REPO_ROOT
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from sdxl_trainer.optimizers.adamw8bit import AdamW8bit
from sdxl_trainer.state.checkpoint_layout import METADATA_FILE
from sdxl_trainer.state.checksums import read_checksums
from sdxl_trainer.state.dcp_json_index import JsonIndexWriter
from sdxl_trainer.state.load import load_training_state
from sdxl_trainer.state.save import TensorStager, stage_training_state, write_staged_state
from sdxl_trainer.state.trainer_state import TrainerState
from sdxl_trainer.state.writer_process import WriterProcess, save_request
from sdxl_trainer.training.stream import DataPosition
from torchao.optim.subclass_8bit import OptimState8bit


class FullDiskWriter(JsonIndexWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")


def sharded_model_and_8bit_state(world) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))
    fully_shard(model, mesh=world.mesh)
    optimizer = AdamW8bit(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    model(torch.randn(4, 128)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def trainer_state(update: int) -> TrainerState:
    return TrainerState(update=update, epoch=0, updates_in_epoch=update, seed=1, optimizer="adamw8bit", use_ema=False, ema_updates=0,
                        world_size=1, global_batch_size=4, gradient_accumulation_steps=1, skipped_updates=0,
                        consecutive_skipped_updates=0, loss_scaler=None)  # fmt: skip


@pytest.mark.multiprocess
def test_the_writer_process_writes_the_same_checkpoint_as_the_training_process(tmp_path, world):
    model, optimizer = sharded_model_and_8bit_state(world)
    exp_avg = optimizer.state[model[0].weight]["exp_avg"]
    assert isinstance(model[0].weight, DTensor) and isinstance(exp_avg.to_local(), OptimState8bit)  # what the request must carry
    stager = TensorStager()
    staged = stage_training_state(model, optimizer, None, trainer_state(3), DataPosition.epoch_start(0), stager)
    by_training = write_staged_state(tmp_path / "by_training", staged)
    writer = WriterProcess.start(torch.distributed.new_group(backend="gloo"))
    try:
        writer.send(save_request(tmp_path / "by_writer", staged, stager.buffer, JsonIndexWriter))
        reply = writer.reply()
        assert set(reply) == {"seconds"}, reply
        # Every file the same, bit for bit, but the index, which names the folder it was written to.
        written, expected = read_checksums(tmp_path / "by_writer"), read_checksums(by_training)
        assert written.keys() == expected.keys() and METADATA_FILE in written
        assert {name: digest for name, digest in written.items() if name != METADATA_FILE} == {
            name: digest for name, digest in expected.items() if name != METADATA_FILE
        }
        fresh_model, fresh_optimizer = sharded_model_and_8bit_state(world)
        for param in fresh_model.parameters():
            param.data.zero_()
        load_training_state(tmp_path / "by_writer", fresh_model, fresh_optimizer, None)
        for param, loaded in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(param.full_tensor(), loaded.full_tensor())
        loaded_avg = fresh_optimizer.state[fresh_model[0].weight]["exp_avg"].to_local()
        assert torch.equal(loaded_avg.codes, exp_avg.to_local().codes) and torch.equal(loaded_avg.scale, exp_avg.to_local().scale)

        # The Ctrl-C and SIGTERM that reach every process of a job leave the writer to its training process.
        os.kill(writer.process.pid, signal.SIGINT)
        os.kill(writer.process.pid, signal.SIGTERM)
        # A full disk is a failed save, reported as the training process would report it; the writer goes on.
        writer.send(save_request(tmp_path / "full", staged, stager.buffer, FullDiskWriter))
        reply = writer.reply()
        assert reply["checkpoint_error"].startswith(f"Could not save a checkpoint to {tmp_path / 'full'} (the disk is full). Earlier checkpoints are untouched.")
        assert not (tmp_path / "full").exists() and not (tmp_path / "full.tmp").exists()
        staged = stage_training_state(model, optimizer, None, trainer_state(4), DataPosition.epoch_start(0), stager)
        writer.send(save_request(tmp_path / "after", staged, stager.buffer, JsonIndexWriter))
        assert set(writer.reply()) == {"seconds"} and json.loads((tmp_path / "after" / "trainer_state.json").read_text())["update"] == 4
    finally:
        writer.close()
    assert writer.process.returncode == 0


KILLED_PARENT = """
import os, signal, sys
from sdxl_trainer.distributed.world import init_distributed
from sdxl_trainer.state.writer_process import WriterProcess
import torch.distributed as dist
init_distributed()
writer = WriterProcess.start(dist.new_group(backend="gloo"))
print(writer.process.pid, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def without_distributed_settings() -> dict[str, str]:
    """This process's environment less the world fixture's settings: the child makes a world of its own."""
    return {**{name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENV}, "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.multiprocess
def test_the_writer_process_dies_with_its_training_process():
    parent = subprocess.Popen([sys.executable, "-c", KILLED_PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env=without_distributed_settings())  # fmt: skip
    writer_pid = int(parent.stdout.readline())
    os.kill(writer_pid, 0)  # alive while its parent is
    parent.stdin.write("\n")
    parent.stdin.flush()
    assert parent.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:  # gone, or a zombie no one reaped (the state after the name in /proc/PID/stat)
            if (open(f"/proc/{writer_pid}/stat").read().rsplit(")", 1)[1].split()[0]) == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.2)
    pytest.fail(f"the writer process {writer_pid} outlived its training process")
