"""How a run starts: where compiled kernels are kept, what train.sh launches, and what the console shows."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO_ROOT, process_env

COMPILE_ONCE = """
import json, sys
import torch
import sdxl_FSDP_train  # the trainer's imports, as in a run (they import torch._dynamo)
from sdxl_trainer.parallel import init_distributed, shutdown_distributed
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
