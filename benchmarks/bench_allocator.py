"""train.sh's glibc allocator settings, measured: the trainer's update on the CPU (the tiny UNet, fp32, 8-bit
AdamW, gradient checkpointing, batch 2 per process, its data read and logged as the trainer does) under
glibc's default settings and under the thresholds train.sh sets (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
read from tools/allocator_settings.sh), in fresh processes alternating for --sessions sessions of each, on 1
and on 2 processes, started as train.sh starts them (python directly for one, the launcher for two).

    venv/bin/python benchmarks/bench_allocator.py [--updates 18] [--processes 1 2] [--sessions 2]

Per process count and setting: ms per update, the training process's CPU time per update (all its threads:
less exposed to a busy machine than the wall time) and its minor page faults per update (heap handed back to
the OS and faulted in again), each the mean over the sessions, and the share of the update spent waiting for
data. The trainer's update is benchmarks/lib/steps.py's, timed by benchmarks/lib/comparison.py.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import numpy as np  # noqa: E402

from benchmarks.lib.processes import cpu_env, launch_command  # noqa: E402

SETTINGS = dict(model="tiny", resolution=256, batch_size=2, gradient_checkpointing=True, optimizer="adamw8bit")
FIGURES = ("seconds_per_step", "cpu_seconds_per_step", "minor_faults_per_step", "data_wait_share")
WARMUP_UPDATES = 2  # compiles the 8-bit AdamW step, warms the allocator and starts the loader's workers


def worker(output: Path, updates: int) -> None:
    """One session: the trainer's update, its figures (rank of most) written to `output` by rank 0."""
    from benchmarks.lib.comparison import Measurement, compare
    from benchmarks.lib.steps import StepSettings
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed

    world = init_distributed()
    (result,) = compare([StepSettings(**SETTINGS)], "none", Measurement(WARMUP_UPDATES, updates, read_data=True), world)
    if world.is_main:
        output.write_text(json.dumps({key: getattr(result, key) for key in FIGURES}))
    shutdown_distributed()


def train_sh_allocator_settings() -> dict[str, str]:
    """The MALLOC_*_ defaults train.sh exports (`export MALLOC_X_=${MALLOC_X_:-value}` in tools/allocator_settings.sh), so
    that this measures them as set."""
    settings = dict(re.findall(r"(MALLOC_\w+_)=\$\{\1:-(\d+)\}", (REPO_ROOT / "tools" / "allocator_settings.sh").read_text()))
    assert settings, "tools/allocator_settings.sh sets no MALLOC_*_ thresholds"
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=18, help="measured updates per session, after the warm-up")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="process counts to measure")
    parser.add_argument("--sessions", type=int, default=2, help="fresh sessions under each allocator setting, alternating")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.updates)
        return
    glibc_defaults = {name: value for name, value in cpu_env().items() if not name.startswith("MALLOC_")}
    allocators = {"glibc defaults": glibc_defaults, "train.sh's thresholds": dict(glibc_defaults, **train_sh_allocator_settings())}
    sessions: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "session.json"
        for processes in args.processes:
            command = launch_command(processes, __file__, ["--worker", str(output), "--updates", str(args.updates)])
            for _ in range(args.sessions):
                for allocator, env in allocators.items():
                    subprocess.run(command, check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
                    sessions.setdefault((processes, allocator), []).append(json.loads(output.read_text()))
    print(f"train.sh's allocator settings: {' '.join(f'{name}={value}' for name, value in train_sh_allocator_settings().items())}")
    print(f"tiny SDXL UNet on the CPU, {SETTINGS['resolution']} px, batch {SETTINGS['batch_size']} per process, {SETTINGS['optimizer']}, fp32, "
          f"gradient checkpointing; {args.updates} updates per session after {WARMUP_UPDATES} of warm-up, {args.sessions} sessions each")
    for (processes, allocator), figures in sessions.items():
        mean = {key: float(np.mean([session[key] for session in figures])) for key in FIGURES}
        print(f"  {processes} process(es), {allocator:21s}: {mean['seconds_per_step'] * 1000:7.1f} ms/update, "
              f"CPU {mean['cpu_seconds_per_step'] * 1000:7.1f} ms/update, {mean['minor_faults_per_step']:6.0f} minor page faults/update, "
              f"data loading {mean['data_wait_share'] * 100:.2f}% of the update")


if __name__ == "__main__":
    main()
