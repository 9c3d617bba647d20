"""benchmarks/bench_background_save.py with the tiny UNet's state: the trainer's updates timed with nothing
written, while the trainer's writer process writes and while a thread writes, in alternating rounds, and the
checkpoints the saves left behind."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes

from sdxl_trainer.state.checkpoints_folder import find_latest_checkpoint
from sdxl_trainer.state.trainer_state import read_trainer_state


@pytest.mark.multiprocess
def test_updates_are_timed_quiet_and_while_the_writer_process_or_a_thread_writes(tmp_path):
    output = tmp_path / "save.json"
    result = run_processes(1, REPO_ROOT / "benchmarks" / "bench_background_save.py",
                           ["--saved_unet", "tiny", "--resolution", "64", "--rounds", "2", "--quiet_updates", "2", "--work_dir", str(tmp_path),
                            "--output", str(output)])  # fmt: skip
    figures = json.loads(output.read_text())
    assert len(figures["update_seconds"]["quiet"]) == 4 and all(seconds > 0 for seconds in figures["update_seconds"]["quiet"])
    assert [len(figures["write_seconds"][kind]) for kind in ("process", "thread")] == [2, 2]  # one write of each kind a round
    assert all(seconds > 0 for kind in ("process", "thread") for seconds in figures["write_seconds"][kind])
    assert set(figures["ratio"]) == {"process", "thread"}
    assert "while the trainer's writer process writes" in result.stdout and "while a thread of the training process writes" in result.stdout
    # The writer process's saves completed and were checksummed: the newest (the limit keeps 1) is from after the
    # warm-up's 2 updates and the first round's 2 quiet ones.
    latest, skipped = find_latest_checkpoint(tmp_path / "process")
    assert latest is not None and skipped == {} and read_trainer_state(latest).update >= 4
    assert not (tmp_path / "thread").exists()
