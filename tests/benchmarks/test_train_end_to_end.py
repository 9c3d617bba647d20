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
    updates, measure_from, save_at, log_every = 8, 2, 4, 2
    result = subprocess.run(
        [sys.executable, "benchmarks/train_end_to_end.py", "--tiny", "--images", "8", "--updates", str(updates), "--measure_from", str(measure_from),
         "--save_at", str(save_at), "--log_every", str(log_every), "--variant", "batch2=--train_batch_size 2 --optimizer adamw", "--variant", "broken=--optimizer no_such_optimizer",
         "--json", str(tmp_path / "battery.json"), "--work_dir", str(tmp_path)],
        cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("FAILED: broken")
    variants = {variant["name"]: variant for variant in json.loads((tmp_path / "battery.json").read_text())["variants"]}
    good, broken = variants["batch2"], variants["broken"]
    assert good["exit_code"] == 0 and good["failure"] == ""
    # logged at 2, 4, 6, 8: the intervals (2, 4] and (6, 8]; (4, 6] holds the save after update 4
    assert good["updates_measured"] == updates - measure_from - log_every
    assert good["ms_per_update"] > 0 and good["images_per_second"] == pytest.approx(2 / good["ms_per_update"] * 1000)
    assert good["save_pause_s"] is not None
    assert good["step_ms_per_update"] > 0 and good["outside_step_ms"] == pytest.approx(good["ms_per_update"] - good["step_ms_per_update"])
    assert broken["exit_code"] != 0 and "no_such_optimizer" in broken["failure"]


def test_the_log_is_timed_between_the_updates_that_log_and_the_save_interval_is_left_out():
    from benchmarks.lib.run_logs import ms_per_update

    # logged every 10 updates and at the last (25): 0.1 s per update, the save after update 20 adds 3 s
    times = {10: 1.0, 20: 2.0, 25: 5.5, 5: 0.5}
    timing = ms_per_update(times, measure_from=10, save_at=20)
    assert timing.updates_measured == 10 and timing.ms_per_update == pytest.approx(100.0)
    assert timing.save_pause_s == pytest.approx(3.0) and timing.window_start == 1.0
    with pytest.raises(ValueError, match="fewer than two logged updates"):
        ms_per_update({10: 1.0}, measure_from=10, save_at=20)
