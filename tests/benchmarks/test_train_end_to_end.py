"""benchmarks/train_end_to_end.py, the GPU battery's speed part, run on the tiny model: it builds its own
cache, runs train.sh per variant, reads each run's ms per update from the run's own TensorBoard log beside the
step benchmark's figure, and a variant that fails is named and fails the battery."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, process_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.end_to_end]


def test_the_battery_times_train_sh_from_its_log_and_names_a_variant_that_fails(tmp_path):
    updates, measure_from, save_at = 8, 2, 5
    result = subprocess.run(
        [sys.executable, "benchmarks/train_end_to_end.py", "--tiny", "--images", "8", "--updates", str(updates), "--measure_from", str(measure_from),
         "--save_at", str(save_at), "--variant", "batch2=--train_batch_size 2 --optimizer adamw", "--variant", "broken=--optimizer no_such_optimizer",
         "--json", str(tmp_path / "battery.json"), "--work_dir", str(tmp_path)],
        cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("FAILED: broken")
    variants = {variant["name"]: variant for variant in json.loads((tmp_path / "battery.json").read_text())["variants"]}
    good, broken = variants["batch2"], variants["broken"]
    assert good["exit_code"] == 0 and good["failure"] == ""
    # updates measure_from+1 .. updates, less the one after the save
    assert good["updates_measured"] == updates - measure_from - 1
    assert good["ms_per_update"] > 0 and good["images_per_second"] == pytest.approx(2 / good["ms_per_update"] * 1000)
    assert good["save_pause_s"] is not None
    assert good["step_ms_per_update"] > 0 and good["outside_step_ms"] == pytest.approx(good["ms_per_update"] - good["step_ms_per_update"])
    assert broken["exit_code"] != 0 and "no_such_optimizer" in broken["failure"]
