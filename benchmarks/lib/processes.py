"""Starting the processes a benchmark measures: 1 or 2 CPU processes of a worker, as train.sh starts the
trainer; and a function run in a fresh Python process of its own."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable

from sdxl_trainer.distributed.world import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_env(**overrides: str) -> dict[str, str]:
    """This environment for CPU workers: no GPU, one compute thread per process (as torchrun gives several),
    the repository importable, warnings quiet; then `overrides`."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO_ROOT), **overrides)


def launch_command(processes: int, script: Path | str, args: list[str]) -> list[str]:
    """`script` on `processes` processes as train.sh starts the trainer: python directly for one (it forms its
    own one-process group), the trainer's launcher (torchrun) for several."""
    if processes == 1:
        return [sys.executable, str(script), *args]
    launcher = [sys.executable, "-m", "sdxl_trainer.distributed.launcher", "--nproc_per_node", str(processes), "--master_port", str(free_port())]
    return [*launcher, str(script), *args]


def call_in_fresh_process(function: Callable[..., Any], *args: Any, log: Path, timeout_s: float) -> Any:
    """function(*args) in a new Python process (spawned: no CUDA context, compiled graph or allocator cache comes
    in or stays behind), its printed output into `log`; its return value, or None if it failed (the log says
    why) or ran out of `timeout_s`."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_call_and_send, args=(function, args, str(log), sender))
    process.start()
    sender.close()  # the child holds its end: a child that dies closes the pipe, and recv() below ends
    if not receiver.poll(timeout_s):
        process.kill()
        process.join()
        with open(log, "a") as handle:
            handle.write(f"\n[call_in_fresh_process] stopped after {timeout_s:.0f} s\n")
        return None
    try:
        result = receiver.recv()
    except EOFError:
        result = None  # the child ended without sending: its log holds the traceback
    process.join()
    return result


def _call_and_send(function: Callable[..., Any], args: tuple, log: str, sender) -> None:
    with open(log, "w") as handle:  # the descriptors themselves, so that C libraries' output goes there too
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
    sender.send(function(*args))
