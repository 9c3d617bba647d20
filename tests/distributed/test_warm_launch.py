"""The suite's torchrun stand-in (warm_launch.py) gives ranks what torchrun gives them, and ends a job as it does."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, process_env, run_processes
from warm_launch import PRELOADED_MODULES, WarmLauncher

pytestmark = pytest.mark.multiprocess

REPORT_ENVIRONMENT = """
import json, multiprocessing, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
names = sorted(name for name in os.environ if name.startswith(("RANK", "LOCAL_", "GROUP_", "ROLE_", "WORLD_", "MASTER_", "TORCHELASTIC_", "TORCH_NCCL", "OMP_")))
report = {"rank": dist.get_rank(), "total": total.item(), "names": names, "argv": sys.argv[1:], "name": __name__,
          "start_method": multiprocessing.get_start_method()}
with open(sys.argv[-1] + f"/rank{dist.get_rank()}.json", "w") as file:
    json.dump(report, file)
dist.destroy_process_group()
"""

ONE_RANK_FAILS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: (print("rank 0 was told to stop", flush=True), sys.exit(0)))
time.sleep(300)
"""


PRELOADED_AND_COMPILED = """
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor.async_compile import AsyncCompile
from tqdm import tqdm
from sdxl_trainer.optimizers.adamw8bit import AdamW8bit

compiled_before = counters["stats"]["unique_graphs"]
monitor_from_the_server = tqdm.monitor is not None
compile_pools_from_the_server = AsyncCompile.pool.cache_info().currsize + AsyncCompile.process_pool.cache_info().currsize
for dtype in (torch.float32, torch.bfloat16):
    parameters = [torch.nn.Parameter(torch.randn(values, dtype=dtype)) for values in (4096 * 3, 77)]
    optimizer = AdamW8bit(parameters, lr=3e-5, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
print(json.dumps({"missing": [name for name in sys.argv[1:] if name not in sys.modules],
                  "compiled_before": compiled_before, "monitor_from_the_server": monitor_from_the_server,
                  "compile_pools_from_the_server": compile_pools_from_the_server, "compiled_here": counters["stats"]["unique_graphs"] - compiled_before}))
"""

KILLED_HOLDING_TQDMS_LOCK = """
import os, signal
from tqdm import tqdm
tqdm.get_lock().acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""

OPENS_A_BAR = """
from tqdm import tqdm
for _ in tqdm(range(3)):
    pass
print("bar done")
"""


def reports(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ranks_get_torchruns_environment_and_form_a_group(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT_ENVIRONMENT)
    (tmp_path / "warm").mkdir()
    (tmp_path / "real").mkdir()
    run_processes(2, script, ["--flag", str(tmp_path / "warm")])
    run_processes(2, script, ["--flag", str(tmp_path / "real")], through_launcher=True)
    warm, real = reports(tmp_path / "warm"), reports(tmp_path / "real")
    assert [report["total"] for report in warm] == [3.0, 3.0]  # 1 + 2, summed over the two ranks
    assert [report["argv"] for report in warm] == [["--flag", str(tmp_path / "warm")]] * 2 and {report["name"] for report in warm} == {"__main__"}
    # Every variable torchrun sets for its workers' rendezvous and identity, and no other.
    assert [report["names"] for report in warm] == [report["names"] for report in real]
    # DataLoader workers start as under torchrun (not from a server of their own that imports the script again).
    assert [report["start_method"] for report in warm] == [report["start_method"] for report in real]


def test_the_first_failing_rank_ends_the_job_with_its_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(ONE_RANK_FAILS)
    result = run_processes(2, script, [], expect_success=False)
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == "rank 1 gives up"
    assert "rank 0 was told to stop" in result.stdout  # SIGTERM, as torchrun sends it, not a kill: it did not sleep on


class _StatusNotYetIn:
    """A rank that has ended and been reaped (by the server, for a warm-launched rank) whose exit status the
    launcher does not see for its first `reads_before_status` reads of exitcode."""

    def __init__(self, process, reads_before_status: int):
        self._process, self._reads_left = process, reads_before_status

    @property
    def exitcode(self):
        self._reads_left -= 1
        return None if self._reads_left >= 0 else self._process.exitcode

    def __getattr__(self, name):
        return getattr(self._process, name)


def test_a_rank_that_ends_while_the_job_is_being_stopped_is_no_error(tmp_path):
    """Both ranks refused a start, the second's status arriving as the first's failure stops the job: the
    stop once signalled a process the server had already reaped (ProcessLookupError, a flaky test)."""
    context = multiprocessing.get_context("fork")
    failing, ending = context.Process(target=sys.exit, args=(3,)), context.Process(target=sys.exit, args=(0,))
    for process in (failing, ending):
        process.start()
        process.join()
    ranks = [failing, _StatusNotYetIn(ending, reads_before_status=2)]
    assert WarmLauncher._wait(ranks, timeout=10, command=["refused.py"], stderr_path=tmp_path / "stderr") == 3


def test_a_rank_starts_with_every_preloaded_module_and_the_optimizer_kernels_compiled(tmp_path):
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED_AND_COMPILED)
    report = json.loads(run_processes(1, script, PRELOADED_MODULES).stdout.splitlines()[-1])
    assert report["missing"] == []
    # The 8-bit step, the fp32 step of small shards and the rounding to bf16, compiled by the server for fp32
    # and bf16 weights: other shard sizes, learning rate, epsilon and weight decay compile nothing in a rank.
    assert report["compiled_before"] == 5 and report["compiled_here"] == 0
    # The server forks from one thread (warm_kernels.py): inductor's compile pool, made on a cache miss, left a
    # rank that compiled more waiting forever on a thread it did not have; tqdm's monitor thread takes tqdm's
    # lock every 10 s.
    assert report["compile_pools_from_the_server"] == 0 and report["monitor_from_the_server"] is False


def test_a_rank_killed_while_holding_tqdms_lock_leaves_the_next_rank_free(tmp_path):
    """The ranks share nothing the server made: tqdm's default lock, a semaphore shared by the processes
    forked after its creation, once hung every rank after one killed while it held the lock."""
    (tmp_path / "killed.py").write_text(KILLED_HOLDING_TQDMS_LOCK)
    (tmp_path / "bar.py").write_text(OPENS_A_BAR)
    assert "ended by SIGKILL" in run_processes(1, tmp_path / "killed.py", [], expect_success=False).stderr
    assert run_processes(1, tmp_path / "bar.py", [], timeout=60).stdout.strip() == "bar done"


PROBE_TESTS = '''
import subprocess, sys

def test_starts_a_python_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_none():
    assert sum(range(4)) == 6
'''


@pytest.mark.multiprocess
def test_the_quick_tier_fails_a_test_that_starts_a_process_and_names_the_marker(tmp_path):
    """run_tests.sh --quick: a test without the multiprocess marker that starts a process fails, naming the marker,
    and the rest pass; the same tests outside the quick tier both pass."""
    (tmp_path / "test_probe.py").write_text(PROBE_TESTS)
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py"), "-p", "no:cacheprovider"]
    env = dict(process_env(), PYTHONPATH=f"{REPO_ROOT / 'tests'}:{REPO_ROOT / 'tests' / 'support'}:{REPO_ROOT}")
    quick = subprocess.run(command, env=dict(env, QUICK_TIER="1"), capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in quick.stdout
    assert "test_starts_a_python_process starts processes: mark it @pytest.mark.multiprocess" in quick.stdout
    everything = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert "2 passed" in everything.stdout
