"""The facts every result file carries, so that a figure can be re-measured and compared: the date, the
machine, the library versions, the git commit and the command; and writing a result as JSON or Markdown
(benchmarks/results/README.md says which files are kept)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread(s) per process)"


def driver_version(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True)
        return query.stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (nvidia-smi did not answer)"


def git_commit() -> str:
    """The checkout's commit, marked when tracked files differ from it; "unknown" outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes" if changed.strip() else commit


def run_facts(device: torch.device) -> dict[str, str]:
    return {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "device": device_name(device),
        "driver": driver_version(device),
        "cuda": torch.version.cuda if device.type == "cuda" else "n/a",
        "torch": torch.__version__,
        "diffusers": version("diffusers"),
        "torchao": version("torchao"),
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def markdown_facts(facts: dict[str, str]) -> str:
    """The facts as the Markdown lines above a result table."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun, WORLD_SIZE={processes}" if processes > 1 else "1 process"
    cuda = f", CUDA {facts['cuda']} (torch build)" if facts["cuda"] != "n/a" else ""
    return "\n".join(
        [
            f"- date: {facts['date']}",
            f"- device: {facts['device']}; driver {facts['driver']}{cuda}",
            f"- torch {facts['torch']}, diffusers {facts['diffusers']}, torchao {facts['torchao']}, python {facts['python']}",
            f"- git commit: {facts['git_commit']}",
            f"- command ({launcher}): `{facts['command']}`",
        ]
    )


def write_json(path: Path, figures: dict, device: torch.device) -> None:
    """run_facts, then `figures` (whose keys win: an estimate on fake tensors names its own device)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**run_facts(device), **figures}, indent=1, default=str) + "\n")
    print(f"Written to {path}")


def write_markdown(path: Path, title: str, report: str, device: torch.device) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{markdown_facts(run_facts(device))}\n{report}\n")
    print(f"Written to {path}")
