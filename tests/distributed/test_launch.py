"""How a run starts: where compiled kernels are kept, what train.sh launches, and what the console shows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, process_env

from sdxl_trainer.distributed.stop_request import StopRequest
from sdxl_trainer.distributed.world import free_port

COMPILE_ONCE = """
import json, sys
import torch
import runpy
runpy.run_path("sdxl_FSDP_train.py")  # the trainer's imports, as in a run (they import torch._dynamo)
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir

init_distributed()
torch.compile(lambda x: (x * 2).sin())(torch.ones(8))
print(json.dumps({"cache_dir": cache_dir(), "counters": dict(counters["inductor"])}))
shutdown_distributed()
"""


def make_venv(folder: Path) -> Path:
    """A fresh virtual env that sees this env's packages (through a .pth file): its own sys.prefix, no copies."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)}))
    (site_packages / "parent_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return folder / "bin" / "python"


@pytest.mark.multiprocess
def test_a_fresh_process_keeps_compiled_kernels_in_its_virtual_env_and_the_next_one_reuses_them(tmp_path):
    python = make_venv(tmp_path / "venv")
    env = process_env()
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        result = subprocess.run([str(python), "-c", COMPILE_ONCE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    expected = tmp_path / "venv" / "compile_cache" / "rank0_of_1"
    assert [Path(run["cache_dir"]) for run in runs] == [expected, expected]
    assert (expected / "fxgraph").is_dir()
    assert runs[0]["counters"].get("fxgraph_cache_miss") == 1
    assert runs[1]["counters"].get("fxgraph_cache_hit") == 1  # a later run reuses the kernel instead of compiling it again


# ---- train.sh: what it starts, and what is left on screen ----------------------------------------------


def recording_venv(folder: Path) -> tuple[Path, Path]:
    """A VENV_DIR whose bin/python writes each call (its pid, arguments and allocator settings) to a log and
    then becomes this env's python (exec: same pid). Returns the folder and the log."""
    log = folder / "calls.log"
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$$ mmap=${{MALLOC_MMAP_THRESHOLD_-unset}} trim=${{MALLOC_TRIM_THRESHOLD_-unset}} $*" >> "{log}"\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return folder, log


def run_train_sh(tmp_path: Path, processes: int | None, flags: list[str], port: int | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """bash train.sh as a user starts it (with NUM_PROCESSES=processes, unless None; MAIN_PROCESS_PORT=port,
    unless None), stdout and stderr on one console; returns the process, its console and the python calls
    train.sh made."""
    venv, log = recording_venv(tmp_path / "venv")
    env = dict(process_env(), VENV_DIR=str(venv))
    # Decided by train.sh unless given (run_tests.sh sets the MALLOC ones).
    for name in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MAIN_PROCESS_PORT", "MASTER_PORT"):
        env.pop(name, None)
    if processes is not None:
        env["NUM_PROCESSES"] = str(processes)
    if port is not None:
        env["MAIN_PROCESS_PORT"] = str(port)
    process = subprocess.Popen(["bash", "train.sh", *flags], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    console, _ = process.communicate(timeout=300)
    return process, console, log.read_text().splitlines()


@pytest.mark.multiprocess
def test_one_process_starts_the_trainer_itself_without_torchrun_and_its_refusal_is_the_last_line(tmp_path, sample_cache_dir):
    process, console, calls = run_train_sh(tmp_path, 1, ["--cached_dataset_dirs", str(sample_cache_dir), "--min_resolution", "512", "--output_dir", str(tmp_path)])
    assert process.returncode == 1
    # train.sh asks for the GPU count, then execs python on the trainer: the process the user started is the trainer.
    trainer_calls = [call for call in calls if "sdxl_FSDP_train.py" in call]
    assert trainer_calls == [f"{process.pid} mmap=33554432 trim=1073741824 sdxl_FSDP_train.py --cached_dataset_dirs {sample_cache_dir} "
                             f"--min_resolution 512 --output_dir {tmp_path}"]
    assert console.rstrip().splitlines()[-1] == (
        f"  --min_resolution 512 does not match the caches: {sample_cache_dir} was made with --min_resolution 256; drop the flag "
        "(the trainer takes the range from the caches) or re-cache with --min_resolution 512"
    )
    assert console.count("Cannot start training:") == 1 and "[rank" not in console


@contextlib.contextmanager
def port_in_use(port: int):
    """`port` on this machine busy while inside: listened on here, unless something else already holds it."""
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", port))
            holder.listen()
        except OSError:
            pass  # in use already (another job on this machine): as busy as it needs to be
        yield


@pytest.mark.multiprocess
def test_two_processes_go_through_the_launcher_and_a_bad_flag_is_the_last_line(tmp_path, sample_cache_dir):
    # No NUM_PROCESSES: a machine without a GPU runs 2 processes, and learns it has none without importing torch.
    # No MAIN_PROCESS_PORT: train.sh picks a free port, so a job already holding torchrun's 29500 is no obstacle.
    with port_in_use(29500):
        process, console, calls = run_train_sh(tmp_path, None, ["--cached_dataset_dirs", str(sample_cache_dir), "--learning_rate", "-1"])
    assert process.returncode == 2
    launch = calls[-1]
    assert launch.startswith(f"{process.pid} mmap=33554432 trim=1073741824 -m sdxl_trainer.distributed.launcher --nproc_per_node 2 ")
    assert " --master_port free " in launch  # the launcher takes a port free at the start
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/dxg").exists() and not Path("/dev/kfd").exists():
        assert calls == [launch]
    assert console.rstrip().splitlines()[-2:] == ["sdxl_FSDP_train.py: error: invalid configuration:", "  --learning_rate must be > 0, got -1.0"]
    assert "usage:" not in console  # the flags parsed; their values are wrong
    assert "Traceback" not in console and "OMP_NUM_THREADS" not in console


@pytest.mark.multiprocess
def test_two_processes_refused_before_training_leave_the_refusal_last(tmp_path, sample_cache_dir):
    process, console, _ = run_train_sh(tmp_path, 2, ["--cached_dataset_dirs", str(sample_cache_dir), "--max_resolution", "1024", "--output_dir", str(tmp_path)])
    assert process.returncode == 1
    assert console.rstrip().splitlines()[-2:] == [
        "Cannot start training:",
        f"  --max_resolution 1024 does not match the caches: {sample_cache_dir} was made with --max_resolution 320; drop the flag "
        "(the trainer takes the range from the caches) or re-cache with --max_resolution 1024",
    ]
    assert console.count("Cannot start training:") == 1  # printed once, by the first rank
    assert "Traceback" not in console and "ChildFailedError" not in console


@pytest.mark.multiprocess
def test_a_port_in_use_is_one_line_naming_it_and_the_fix(tmp_path):
    """A port given in MAIN_PROCESS_PORT that another job holds: torchrun's 40-line EADDRINUSE traceback
    becomes one line, before any rank starts."""
    port = free_port()
    with port_in_use(port):
        process, console, _ = run_train_sh(tmp_path, 2, ["--cached_dataset_dirs", str(tmp_path)], port=port)
    assert process.returncode == 1
    assert console.rstrip().splitlines() == [
        f"Port {port} of the rendezvous (MAIN_PROCESS_PORT) is in use on this machine, by another run or program: give another "
        "(the same on every machine), or leave MAIN_PROCESS_PORT unset on a single machine and train.sh picks a free one."
    ]


class StoreCallInFlight:
    """A rendezvous store whose check blocks until released, as a TCPStore call of a loaded machine does."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.entered.set()
        self.release.wait(30)
        return False


def test_a_run_that_ends_well_leaves_no_watchdog_thread_inside_a_store_call():
    """A watchdog thread still inside a store call when the interpreter shuts down is ended there by a forced
    unwind through the store's C++ frames, which aborted a finished run (SIGABRT, "terminate called without
    an active exception", after its model was saved): a clean exit waits for the call to return."""
    from sdxl_trainer.distributed.watchdog import JobWatchdog

    watchdog = JobWatchdog(rank=0, world_size=1)
    store = StoreCallInFlight()
    watchdog._store = store  # a 2-process job's store, without a job
    with watchdog:
        assert store.entered.wait(30)  # the thread is inside the call now
        threading.Timer(0.5, store.release.set).start()
    assert [thread.name for thread in threading.enumerate() if thread.name == "job-watchdog"] == []


OUTLIVES_ITS_SHELL = """
import sys, time
from pathlib import Path
from sdxl_trainer.distributed.watchdog import POLL_S, JobWatchdog

ready, marker = map(Path, sys.argv[1:])
with JobWatchdog(rank=0, world_size=1):
    ready.touch()  # the shell ends now
    time.sleep(5 * POLL_S)  # several of the watchdog's checks of its parent
    marker.write_text("still running")
"""


@pytest.mark.multiprocess
def test_a_trainer_started_without_a_launcher_outlives_the_shell_that_started_it(tmp_path):
    ready, marker = tmp_path / "ready", tmp_path / "marker"
    env = process_env()
    env.pop("TORCHELASTIC_RUN_ID", None)
    # The shell starts python in the background and ends once python runs under its watchdog, as a closed
    # terminal or the end of a `nohup bash train.sh &` session would.
    shell = f'"{sys.executable}" -c "$0" "{ready}" "{marker}" > /dev/null 2>&1 & while [ ! -e "{ready}" ]; do sleep 0.1; done'
    subprocess.run(["bash", "-c", shell, OUTLIVES_ITS_SHELL], cwd=REPO_ROOT, env=env, check=True, timeout=120)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), "the trainer ended with the shell that started it"


REFUSED_START_AFTER_A_DRY_RUN = """
import importlib.abc, runpy, sys

class SayWhenImported(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ('diffusers', 'transformers', 'torchao', 'spandrel', 'torchvision', 'torch_fidelity'):
            print(f"imported {name}", flush=True)
        return None  # the usual finders import it

sys.meta_path.insert(0, SayWhenImported())
cache_dir, output_dir = sys.argv[1:]
sys.argv = ["sdxl_process_data_dir.py", "--data_dir", "sample_dataset", "--cache_dir", output_dir + "/cache", "--dry_run"]
try:
    runpy.run_path("sdxl_process_data_dir.py", run_name="__main__")
except SystemExit as done:
    assert done.code == 0
print("the dry run loaded", [name for name in ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo") if name in sys.modules])
sys.argv = ["sdxl_FSDP_train.py", "--cached_dataset_dirs", cache_dir, "--min_resolution", "512", "--output_dir", output_dir]
runpy.run_path("sdxl_FSDP_train.py", run_name="__main__")  # refused: the process ends
"""


@pytest.mark.multiprocess
def test_a_dry_run_and_a_refused_start_never_import_the_model_libraries(tmp_path, sample_cache_dir):
    """A start refused for its flags, caches or run folder, and a dry run of the caching script, end before the
    model libraries (and the image-metric ones) load: in the seconds torch takes to import, not the 10-15 s a full
    start takes on a CPU core."""
    result = subprocess.run(
        [sys.executable, "-c", REFUSED_START_AFTER_A_DRY_RUN, str(sample_cache_dir), str(tmp_path)],
        cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1
    assert "would cache 25 (upscaled: 0); would skip 5 (too small: 5)" in result.stdout
    assert "the dry run loaded []" in result.stdout  # nor torch's parallel and compiler modules (3 s of its 6)
    assert result.stderr.rstrip().splitlines()[-1].startswith("  --min_resolution 512 does not match the caches")
    assert [line for line in result.stdout.splitlines() if line.startswith("imported ")] == []


IMPORTS_THE_TRAINER_AND_MAKES_TOKENIZERS = """
import runpy, sys
runpy.run_path("sdxl_FSDP_train.py")  # the trainer's imports
from sdxl_trainer.models.sdxl import sdxl_tokenizers
sdxl_tokenizers()  # CLIP's vocabulary is a file of open_clip's, read without importing it
print(sorted(name for name in ('open_clip', 'timm', 'wandb') if name in sys.modules))
"""


@pytest.mark.multiprocess
def test_importing_the_trainer_prints_nothing_and_leaves_the_image_metric_libraries_out():
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_THE_TRAINER_AND_MAKES_TOKENIZERS],
        cwd=REPO_ROOT, env=dict(process_env(), PYTHONWARNINGS="default"), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == "[]\n"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_is_announced_by_one_rank_only(capsys, stop_signal):
    """SIGINT (Ctrl-C) is announced as SIGTERM (a cluster's stop) is, and stops the same way."""
    for announce in (True, False):
        stop = StopRequest(announce=announce)
        stop.training_begins()
        try:
            os.kill(os.getpid(), stop_signal)
        finally:
            stop.restore_handlers()
        assert stop.signal_name == stop_signal.name
        assert capsys.readouterr().out.count(f"{stop_signal.name} received: finishing the current update") == (1 if announce else 0)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_start_up_ends_it_at_once_in_one_line(stop_signal):
    """Before training begins there is nothing to save: the start-up ends where it was, with a line naming the
    signal (the watchdog prints a SystemExit's message alone, no traceback). The same signal again, as torchrun
    forwards the one the terminal sent it too, does not interrupt that ending."""
    stop = StopRequest(announce=True)
    try:
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), stop_signal)
            time.sleep(5)  # the handler runs at the next bytecode: never reached
        os.kill(os.getpid(), stop_signal)
        time.sleep(0.1)  # a second raise would come out here
    finally:
        stop.restore_handlers()
    assert str(stopped.value.code) == (
        f"{stop_signal.name} received during start-up, before the first update: stopped there (nothing was trained yet, so there was nothing to save)."
    )
    assert stop.signal_name is None  # not a request to stop after an update


def test_objects_alive_after_the_imports_are_left_out_of_later_garbage_collections():
    """The trainer and the caching script freeze what their imports made: a full collection then walks only
    what was created since, and still frees that."""
    import gc
    import weakref

    from sdxl_trainer.runtime.garbage_collection import exempt_live_objects_from_garbage_collection

    class Node:
        pass

    alive = [[index] for index in range(1000)]
    def walked_by_a_full_collection() -> int:
        oldest = {id(obj) for obj in gc.get_objects(generation=2)}
        return sum(id(item) in oldest for item in alive)

    gc.collect()  # moves them to the oldest generation
    assert walked_by_a_full_collection() == len(alive)
    try:
        exempt_live_objects_from_garbage_collection()
        assert gc.get_freeze_count() >= len(alive)
        assert walked_by_a_full_collection() == 0
        cycle = Node()
        cycle.itself = cycle
        made_after = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert made_after() is None
    finally:
        gc.unfreeze()


@pytest.mark.multiprocess
def test_a_rank_killed_without_a_word_leaves_one_short_line_from_the_other_and_its_traceback_in_train_log(tmp_path):
    """kill -9 of one rank (the kernel's out-of-memory killer does the same) fails the other rank's next collective:
    it printed 'The whole job is stopping after this error:' and a traceback of some 70 lines above the launcher's
    line naming the killed rank, the one that matters. Now the surviving rank says in one line what happened and
    where its traceback is (train.log, on rank 0), and nothing else comes between it and the launcher's line."""
    from conftest import run_processes

    result = run_processes(2, REPO_ROOT / "tests" / "support" / "watchdog_worker.py", ["killed", str(tmp_path)], expect_success=False, merge_output=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 1
    assert lines[-1].startswith("Rank 1 (process ") and "was ended by SIGKILL without a message of its own" in lines[-1], lines
    assert lines[-2].startswith("[rank 0] The whole job is stopping (exit code 1): a collective with the other ranks failed ("), lines
    assert lines[-2].endswith("so another rank has probably ended without a message of its own (the launcher names it; SIGKILL is often "
                              f"the out-of-memory killer); its traceback is in {tmp_path / 'train.log'}."), lines
    # Before them only what the launcher's SIGTERM (sent once the killed rank was gone) made the stop request say.
    assert all(line.startswith("SIGTERM received") for line in lines[:-2]) and "Traceback" not in result.stdout, lines
    log = (tmp_path / "train.log").read_text()
    assert "[rank 0] The traceback of the failed collective (the line after it says why):\nTraceback (most recent call last)" in log
    assert "all_reduce" in log and log.rstrip().endswith(lines[-2])
    assert "a collective with the other ranks failed (Connection closed by peer [127.0.0.1]:" in lines[-2]


@pytest.mark.multiprocess
def test_a_stop_every_rank_reaches_comes_after_what_the_ranks_printed_before_it(tmp_path):
    """The stop for skipped updates said which checkpoint to resume from above the line that said it was saved: the
    rank that printed the stop did not wait for the other rank's buffered stdout. Every rank's output is out before
    the stop message, whichever rank prints it."""
    from conftest import run_processes

    result = run_processes(2, REPO_ROOT / "tests" / "support" / "watchdog_worker.py", ["stop", str(tmp_path)], expect_success=False, merge_output=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 1
    assert lines == ["Saved state to the checkpoint the stop names.", "Stopped: resume from the checkpoint named above."], lines
