"""State saves in the background (state/checkpointer.py): the loop goes on while a save is written, and a
process killed during a background save leaves the previous checkpoint, which resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO_ROOT, run_processes
from safetensors.torch import load_file

from sdxl_trainer.state.checkpoint_layout import TRAINER_STATE_FILE
from sdxl_trainer.state.checkpoints_folder import checkpoint_name, find_latest_checkpoint

WORKER = REPO_ROOT / "tests" / "support" / "background_save_worker.py"


@pytest.mark.multiprocess
def test_a_process_killed_during_a_background_save_resumes_from_the_previous_checkpoint_bitwise(tmp_path, tiny_pipeline_dir):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    run_processes(2, WORKER, ["straight", str(tiny_pipeline_dir), str(straight)])
    result = run_processes(2, WORKER, ["killed", str(tiny_pipeline_dir), str(killed)], expect_success=False)
    assert result.returncode != 0
    checkpoints = killed / "checkpoints"
    # update 3's save died after rank 1 wrote its shards: only its .tmp folder, never counted
    assert (checkpoints / (checkpoint_name(3) + ".tmp")).is_dir() and not (checkpoints / checkpoint_name(3)).exists()
    latest, skipped = find_latest_checkpoint(checkpoints)
    assert latest == checkpoints / checkpoint_name(2) and skipped == {} and (latest / TRAINER_STATE_FILE).is_file()
    run_processes(2, WORKER, ["resumed", str(tiny_pipeline_dir), str(killed)])
    expected, resumed = load_file(straight / "straight.safetensors"), load_file(killed / "resumed.safetensors")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[key], resumed[key]) for key in expected)
    # the straight run's save was written while updates 3 and 4 trained, and holds update 2's state
    assert (straight / "checkpoints" / checkpoint_name(2) / TRAINER_STATE_FILE).is_file()
