"""benchmarks/bench_background_save.py on the tiny UNet: the trainer's updates timed with a background save's
write in flight and without one, in alternating rounds, and the checkpoints the saves left behind."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes

from sdxl_trainer.state.checkpoints_folder import find_latest_checkpoint


@pytest.mark.multiprocess
def test_updates_are_timed_with_and_without_a_write_in_flight(tmp_path):
    output = tmp_path / "save.json"
    result = run_processes(1, REPO_ROOT / "benchmarks" / "bench_background_save.py",
                           ["--resolution", "64", "--rounds", "2", "--updates_per_round", "2", "--work_dir", str(tmp_path), "--output", str(output)])  # fmt: skip
    figures = json.loads(output.read_text())
    assert len(figures["quiet_seconds"]) == 4 and figures["saving_updates"] == 4
    assert 0 < len(figures["overlapped_seconds"]) <= 4 and figures["ratio"] > 0
    assert "ratio:" in result.stdout
    # every save completed and checksummed: the newest (the limit keeps 1) is the last one, started before the
    # 10th update (2 warm-up updates, then 2 rounds of 2 quiet and 2 saving updates)
    latest, skipped = find_latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == "update_00000009" and skipped == {}
