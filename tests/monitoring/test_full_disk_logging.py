"""Logging on a disk that fills up: TensorBoard's scalars and train.log each cost one warning, not the run;
TensorBoard logging resumes once the disk has room."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, process_env, scalars, small_filesystem_prefix


def run_on_a_small_disk(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run a Python script with a 1 MB filesystem of its own mounted at tmp_path/disk (its path is the script's
    argument), which must exit 0. Returns the run, the mount point and where its files were copied afterwards."""
    mounted, copied = tmp_path / "disk", tmp_path / "copied"
    command = [*small_filesystem_prefix(mounted, copied, "1m"), sys.executable, "-c", script, str(mounted)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, mounted, copied


# Writes scalars, fills the disk, writes more (TensorBoard's writer thread fails, and the error reaches the
# next write), frees the disk and writes again. Runs in its own process, on a small filesystem of its own.
WRITER_ON_A_DISK_THAT_FILLS = """
import sys, time
from pathlib import Path
from sdxl_trainer.monitoring.metrics_writer import MetricsWriter

disk = Path(sys.argv[1])
writer = MetricsWriter(disk / "run" / "tensorboard", True, retry_after_seconds=0.5)
writer.scalars({"train/loss": 1.0}, 1)
filler = disk / "filler"
with open(filler, "wb", buffering=0) as file:
    try:
        while True:
            file.write(bytes(4096))
    except OSError:
        pass
for step in range(2, 40):  # more than the event file's last page holds
    writer.scalars({"train/loss": float(step), **{f"filler/{number}": 0.0 for number in range(100)}}, step)
    time.sleep(0.02)
filler.unlink()
time.sleep(0.5)
writer.scalars({"train/loss": 500.0}, 500)
writer.close()
print("done")
"""


@pytest.mark.multiprocess
def test_a_full_disk_costs_the_scalars_written_meanwhile_and_one_warning_not_the_run(tmp_path):
    result, mounted, copied = run_on_a_small_disk(WRITER_ON_A_DISK_THAT_FILLS, tmp_path)
    assert result.stdout.strip() == "done"
    warning = f"Warning: could not write TensorBoard logs to {mounted / 'run' / 'tensorboard'} ([Errno 28] No space left on device)"
    assert result.stderr.count("Warning: could not write TensorBoard logs") == 1 and warning in result.stderr, result.stderr[-3000:]
    logged = scalars(copied / "run", "train/loss")
    assert logged[0] == 1.0 and logged[-1] == 500.0  # before the disk filled, and in a new event file once it had room


# Prints a line into train.log, fills the disk, then prints more than the file's last page holds.
CONSOLE_ON_A_DISK_THAT_FILLS = """
import sys
from pathlib import Path
from sdxl_trainer.monitoring.console_log import ConsoleLog

disk = Path(sys.argv[1])
with ConsoleLog(disk / "run" / "train.log", True):
    print("before the disk filled")
    with open(disk / "filler", "wb", buffering=0) as file:
        try:
            while True:
                file.write(bytes(4096))
        except OSError:
            pass
    for number in range(100):
        print(f"line {number}: " + "x" * 100)
print("done")
"""


@pytest.mark.multiprocess
def test_a_full_disk_stops_train_log_with_one_warning_and_the_console_keeps_every_line(tmp_path):
    result, mounted, copied = run_on_a_small_disk(CONSOLE_ON_A_DISK_THAT_FILLS, tmp_path)
    assert result.stdout.splitlines() == ["before the disk filled", *(f"line {number}: " + "x" * 100 for number in range(100)), "done"]
    warning = f"Warning: could not append to {mounted / 'run' / 'train.log'} ([Errno 28] No space left on device)"
    assert result.stderr.count("Warning: could not append to") == 1 and warning in result.stderr, result.stderr[-3000:]
    assert (copied / "run" / "train.log").read_text().startswith("before the disk filled\n")
