"""Start a test's trainer (or worker) ranks without paying the imports again: a torchrun stand-in for tests.

Every rank the suite starts would spend some 10 s importing torch, diffusers and transformers before it
does a few seconds of tiny-model work; with some 70 launches that was a third of the suite's time. Here one
server process (multiprocessing's forkserver) imports those modules once per pytest worker, and each rank
is a fork of it that runs the script as `python script.py ARGS` would, in the environment torchrun gives
its workers: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of a rendezvous store that this process hosts
(torchrun's agent store, TORCHELASTIC_USE_AGENT_STORE=True), the TORCHELASTIC_* variables. Like torchrun,
it stops the other ranks as soon as one fails and reports the first failure's exit code; the ranks' output goes to
one stdout and one stderr, as under torchrun. One process is started as train.sh starts it: no launcher
environment at all (the trainer forms its own one-process group).

What is left to torchrun itself (its exit codes and output on a failure, a killed launcher, signals sent to
it) is tested through the real launcher (conftest.run_processes(..., through_launcher=True), test_launch.py).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

from sdxl_trainer.runtime.garbage_collection import exempt_live_objects_from_garbage_collection

# What a rank of the trainer or of a test worker imports before its first line of work, and what they import
# later on most runs: the model libraries (once a run's checks pass), the compiler (the 8-bit AdamW step),
# TensorBoard, the metric libraries; then the optimizer kernels a rank would compile on its first update
# (warm_kernels.py).
PRELOADED_MODULES = [
    "sdxl_trainer.jobs.train_build", "sdxl_trainer.jobs.train_loop", "sdxl_trainer.jobs.cache_job", "sdxl_trainer.models.tiny", "diffusers.schedulers.scheduling_ddpm",
    "torch.distributed.checkpoint", "torch._inductor.compile_fx", "torch.utils.tensorboard", "torchmetrics", "metric_networks",
    "warm_kernels",
]
# torchrun's grace between SIGTERM and SIGKILL for the ranks left when one failed.
STOP_GRACE_S = 30
POLL_S = 0.05


def _forkserver_context(server_env: dict[str, str]) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once) in `server_env`: variables read at import time
    (HF_HUB_OFFLINE, PYTHONWARNINGS, CUDA_VISIBLE_DEVICES) must hold when the server imports."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(server_env)
    # Python 3.11's server ignores the sys.path it is sent and skips a module it cannot import without a word:
    # this folder's modules (metric_networks, warm_kernels) must be on its PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), server_env.get("PYTHONPATH")]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


def _run_rank(script: str, args: list[str], env: dict[str, str], cwd: str, stdout_path: str, stderr_path: str) -> None:
    """In the forked rank: become `python script ARGS` in `env` and `cwd`, writing to the job's two files."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A forkserver's child inherits "forkserver" as its default start method, so the script's DataLoader
    # workers would each wait for a new server to import the script again; `python script.py` starts with
    # the platform's default (fork on Linux before Python 3.14).
    multiprocessing.set_start_method(None, force=True)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))  # as `python script.py` puts it first
    # What the trainer and the caching script do once their imports are done, here for every script: the
    # ~560,000 objects inherited from the server stay out of the rank's full collections. Resharding test's
    # ranks: 10-30% less time.
    exempt_live_objects_from_garbage_collection()
    exit_code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            exit_code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            exit_code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, as the rank's last words
        traceback.print_exc()
        exit_code = 1
    # What the interpreter does at exit and multiprocessing skips in a forked child: the atexit handlers.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class WarmLauncher:
    def __init__(self, server_env: dict[str, str]):
        self._context = _forkserver_context(server_env)

    def run(
        self, num_processes: int, script: Path, args: list[str], env: dict[str, str], cwd: Path, timeout: float,
        while_running: Callable[[list[multiprocessing.process.BaseProcess]], None] | None = None, merge_output: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run the ranks to their end, as `subprocess.run(torchrun ..., capture_output=True, text=True)` would;
        `while_running`, given the ranks' processes (pid, exitcode) once they started, acts on the job (a
        signal to a rank) before the wait for its end. `merge_output`: stdout and stderr into one file, in the
        order written (as `2>&1` into a log file), all of it in the result's stdout."""
        import torch.distributed as dist

        with tempfile.TemporaryDirectory(prefix="warm-launch-") as folder:
            stdout_path = Path(folder) / "stdout"
            stderr_path = stdout_path if merge_output else Path(folder) / "stderr"
            rank_envs = [dict(env) for _ in range(num_processes)]
            if num_processes > 1:
                store = dist.TCPStore(  # lives as long as the job: the ranks' rendezvous
                    "127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
                for rank, rank_env in enumerate(rank_envs):
                    rank_env.update(
                        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                        WORLD_SIZE=str(num_processes), LOCAL_WORLD_SIZE=str(num_processes), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(num_processes),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                        TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                        TORCHELASTIC_ERROR_FILE=str(Path(folder) / f"error_{rank}.json"), TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                        TORCH_NCCL_ASYNC_ERROR_HANDLING="1", OMP_NUM_THREADS="1",
                    )
            ranks = [
                self._context.Process(target=_run_rank, args=(str(script), list(args), rank_env, str(cwd), str(stdout_path), str(stderr_path)))
                for rank_env in rank_envs
            ]
            for rank in ranks:
                rank.start()
            try:
                if while_running is not None:
                    while_running(ranks)
                return_code = self._wait(ranks, timeout, [str(script), *args], stderr_path)
            finally:
                for rank in ranks:
                    if rank.exitcode is None:
                        rank.kill()
                        rank.join()
            return subprocess.CompletedProcess(
                [str(script), *args], return_code, stdout_path.read_text(errors="replace"), "" if merge_output else stderr_path.read_text(errors="replace")
            )

    @staticmethod
    def _wait(ranks: list, timeout: float, command: list[str], stderr_path: Path) -> int:
        """torchrun's rule: the first rank to fail ends the job (SIGTERM to the rest, SIGKILL after a grace);
        its exit code is the job's; a rank ended by a signal is named in one line, as sdxl_trainer.distributed.launcher does."""
        deadline = time.monotonic() + timeout
        failed, kill_at = None, None
        while any(rank.exitcode is None for rank in ranks):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(command, timeout, stderr=stderr_path.read_text(errors="replace"))
            if failed is None:
                failed = next((rank for rank in ranks if rank.exitcode not in (None, 0)), None)
                if failed is not None:
                    for rank in ranks:
                        if rank.exitcode is None:
                            # Not os.kill: a rank that ended since exitcode was read is gone (ESRCH), which terminate() allows.
                            rank.terminate()
                    kill_at = time.monotonic() + STOP_GRACE_S
            elif time.monotonic() > kill_at:
                for rank in ranks:
                    if rank.exitcode is None:
                        rank.kill()
            multiprocessing.connection.wait([rank.sentinel for rank in ranks if rank.exitcode is None], timeout=POLL_S)
        failed = failed or next((rank for rank in ranks if rank.exitcode != 0), None)
        if failed is None:
            return 0
        if failed.exitcode > 0:
            return failed.exitcode
        with open(stderr_path, "a") as stderr:
            stderr.write(f"Rank {ranks.index(failed)} (process {failed.pid}) was ended by {signal.Signals(-failed.exitcode).name} without a message of its own\n")
        return 1
