"""CPU smoke test of benchmarks/train_throughput.py, the trainer against a plain loop, on the tiny SDXL UNet:
the batch x checkpointing sweep on 1 process (trainer next to the plain reference loop, one path after the
other) and one configuration on 2 processes (FSDP2 over gloo, reference = the hand-written FSDP2 loop, the
trainer reading and logging its data as the trainer does, the paths alternating in rounds); plus the library
it runs on (benchmarks/lib/): its FLOP count, profile summary, table, and the command's argument checks."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT, run_processes
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.lib.comparison import PathResult, table
from benchmarks.lib.flops import flop_per_image
from benchmarks.lib.profiling import time_split
from benchmarks.lib.steps import StepSettings, reference_loss
from benchmarks.lib.unets import new_batch, new_unet, noise_scheduler

SCRIPT = REPO_ROOT / "benchmarks" / "train_throughput.py"
# adamw: torchao's 8-bit step compiles for minutes on a cold 2-core machine; the paths are the same otherwise.
TINY = ["--model", "tiny", "--resolution", "32", "--warmup_steps", "0", "--measured_steps", "1", "--optimizer", "adamw"]
NUMERIC_COLUMNS = ("images/s per GPU", "ms per step", "optimizer ms", "MFU %", "step time / reference")


@pytest.fixture(scope="module")
def command():
    """The command itself, for its argument checks."""
    spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def table_rows(text: str) -> list[dict[str, str]]:
    lines = [line.strip().strip("|") for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].split("|")]
    assert header == ["batch", "checkpointing", "path", "images/s per GPU", "ms per step", "optimizer ms", "MFU %", "peak allocated GiB",
                      "peak reserved GiB", "step time / reference"]
    return [dict(zip(header, (cell.strip() for cell in line.split("|")))) for line in lines[2:]]


def assert_measured(row: dict[str, str]) -> None:
    for column in NUMERIC_COLUMNS:
        value = float(row[column])
        assert math.isfinite(value) and value > 0, (column, row)
    assert float(row["optimizer ms"]) < float(row["ms per step"])
    assert row["peak allocated GiB"] == row["peak reserved GiB"] == "n/a"  # no per-path memory figure on the CPU
    if row["path"].startswith("reference"):
        assert float(row["step time / reference"]) == 1.0


@pytest.mark.multiprocess
def test_sweep_on_one_process(tmp_path):
    output, figures = tmp_path / "results" / "tiny.md", tmp_path / "results" / "tiny.json"
    result = run_processes(1, SCRIPT, [*TINY, "--sweep", "--output", str(output), "--json", str(figures)], timeout=300)
    rows = table_rows(result.stdout)
    assert [(row["batch"], row["checkpointing"], row["path"]) for row in rows] == [
        (batch, checkpointing, path)
        for checkpointing in ("on", "off")
        for batch in ("1", "4", "8")
        for path in ("reference (plain)", "trainer")
    ]
    for row in rows:
        assert_measured(row)
    written = output.read_text()
    assert table_rows(written) == rows
    for fact in ("date:", "device: CPU", "driver n/a (CPU)", "torch 2.", "diffusers ", "torchao ", "git commit: ", "command (1 process)", "--sweep"):
        assert fact in written, fact
    assert "peak resident size" in result.stdout
    written = json.loads(figures.read_text())
    assert (written["processes"], written["compute_dtype"], written["settings"]["sweep"]) == (1, "float32", True)
    assert written["device"].startswith("CPU") and written["git_commit"] and "--sweep" in written["command"]
    assert len(written["rows"]) == len(rows)
    for row, figure in zip(rows, written["rows"]):
        assert (str(figure["batch_size"]), figure["path"]) == (row["batch"], row["path"])
        assert f"{figure['images_per_second']:.3f}" == row["images/s per GPU"]
        assert figure["first_step_seconds"] is None  # no warm-up step to time
        assert figure["cpu_seconds_per_step"] > 0 and figure["data_wait_share"] is None  # the batch stays in memory


@pytest.mark.multiprocess
def test_two_processes_compare_with_the_fsdp2_loop(tmp_path):
    profiles, figures = tmp_path / "profiles", tmp_path / "figures.json"
    result = run_processes(2, SCRIPT, [*TINY, "--batch_size", "2", "--data_loading", "--rounds", "2", "--profile", str(profiles), "--json", str(figures)],
                           timeout=300)
    rows = table_rows(result.stdout)
    assert [row["path"] for row in rows] == ["reference (fsdp2)", "trainer"]
    for row in rows:
        assert row["batch"] == "2"
        assert_measured(row)
    assert "2 process(es)" in result.stdout and "2 alternating rounds of 1 measured steps" in result.stdout
    # --data_loading: the trainer read its updates through its data stream's workers and logged them; the reference did not.
    reference, trainer = json.loads(figures.read_text())["rows"]
    assert 0 < trainer["data_wait_share"] < 1 and reference["data_wait_share"] is None
    assert "waiting for data" in result.stdout
    # --profile: each path's operator table and its summary, from rank 0 (no device figures on a CPU).
    summaries = json.loads((profiles / "profiles.json").read_text())
    assert sorted(summaries) == ["reference_batch2_ckpton", "trainer_batch2_ckpton"]
    for label, summary in summaries.items():
        assert summary["steps"] == 2
        assert 0 < summary["optimizer_host_ms_per_step"] < summary["wall_ms_per_step"], summary
        assert summary["device_busy_ms_per_step"] is summary["optimizer_kernel_ms_per_step"] is None
        operators = (profiles / f"{label}.txt").read_text()
        assert "aten::convolution" in operators
        # The optimizer step's line of its own: its self-time row fell out of the table's 40 under load.
        assert re.search(r"^Optimizer\.step#ShardAdamW\.step: 2 calls, [0-9.]+ ms of host time in all$", operators, re.MULTILINE), operators[-500:]


def test_time_split_counts_overlapping_kernels_once_and_the_optimizer_inside_its_gpu_span():
    """The profile's figures from hand-made events (µs): two steps; kernels overlap on two streams, the
    optimizer step runs 10-30 on the host and 40-80 on the GPU, where one kernel straddles its start."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, start, end, device_type, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device_type, is_user_annotation=annotation)

    events = [
        event("aten::mm", 0, 5, cpu),
        event("Optimizer.step#AdamW8bit.step", 10, 30, cpu),
        event("Optimizer.step#AdamW8bit.step", 40, 80, cuda, annotation=True),
        event("gemm", 0, 20, cuda),
        event("gemm on stream 2", 10, 30, cuda),  # overlaps the first: busy 0-30 counts 30
        event("elementwise", 35, 50, cuda),  # 40-50 inside the optimizer's GPU span
        event("triton_red_fused_amax", 60, 70, cuda),
        event("ProfilerStep", 0, 100, cuda, annotation=True),  # an annotation is no kernel
    ]
    split = time_split(events, steps=2, wall_seconds=0.0002, on_gpu=True)
    assert split == {
        "steps": 2,
        "wall_ms_per_step": pytest.approx(0.1),
        "optimizer_host_ms_per_step": pytest.approx(0.010),
        "device_busy_ms_per_step": pytest.approx(0.0275),  # (30 + 15 + 10) µs over 2 steps
        "kernels_per_step": 2.0,
        "optimizer_device_ms_per_step": pytest.approx(0.020),
        "optimizer_kernel_ms_per_step": pytest.approx(0.010),  # 40-50 and 60-70
    }
    on_cpu = time_split(events[:2], steps=2, wall_seconds=0.0002, on_gpu=False)
    assert on_cpu["optimizer_host_ms_per_step"] == pytest.approx(0.010) and on_cpu["device_busy_ms_per_step"] is None


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flop_count_on_meta_equals_a_real_run(checkpointing):
    unet = new_unet("tiny", "fp32", checkpointing, "cpu")
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        reference_loss(unet, new_batch(unet, 32, 1, "cpu"), noise_scheduler()).backward()
    counted = flop_per_image("tiny", 32, checkpointing)
    assert counted == counter.get_total_flops() > 0
    if checkpointing:  # the recomputed forward counts
        assert counted > flop_per_image("tiny", 32, False)


def test_bf16_weights_start_from_the_fp32_weights_rounded():
    fp32 = new_unet("tiny", "fp32", True, "cpu")
    bf16 = new_unet("tiny", "bf16", True, "cpu")
    for (name, full), (_, rounded) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert rounded.dtype == torch.bfloat16, name
        torch.testing.assert_close(rounded, full.to(torch.bfloat16), rtol=0, atol=0)


def test_table_marks_out_of_memory_and_divides_by_the_reference():
    tiny = StepSettings(model="tiny", resolution=32)  # FLOP counts cached by the test above
    fits, too_big = tiny.with_row(2, True), tiny.with_row(8, False)
    results = [
        PathResult(fits, "reference (plain)", 0.5, 20.0, 0.05, 3.0, 4.0),
        PathResult(fits, "trainer", 0.55, 21.0, None, 2.5, 3.0),  # fp16: every timed step skipped on overflow
        PathResult(too_big, "reference (plain)", None, None, None, 70.0, 79.0),
        PathResult(too_big, "trainer", 0.9, 30.0, 0.2, 60.0, 70.0),
    ]
    rows = table_rows(table(results, peak_flops=1e12))
    assert float(rows[1]["step time / reference"]) == pytest.approx(1.1)
    assert float(rows[0]["images/s per GPU"]) == pytest.approx(4.0)  # batch 2 in 0.5 s
    mfu = 4.0 * flop_per_image("tiny", 32, True) / 1e12 * 100
    assert float(rows[0]["MFU %"]) == pytest.approx(mfu, rel=0.01)
    assert (rows[0]["optimizer ms"], rows[1]["optimizer ms"], rows[3]["optimizer ms"]) == ("50.0", "n/a", "200.0")
    assert [rows[2][column] for column in ("images/s per GPU", "ms per step", "optimizer ms", "MFU %", "step time / reference")] == ["OOM"] * 5
    assert rows[2]["peak allocated GiB"] == "70.00"  # the peak it reached before running out
    assert rows[3]["step time / reference"] == "n/a"  # nothing to divide by


def test_argument_checks_name_the_fix(command):
    args = command.parse_args(["--model", "tiny", "--resolution", "40", "--reference", "plain", "--measured_steps", "0", "--attention", "efficient",
                               "--sweep", "--batch_size", "4", "--rounds", "0"])
    problems = "\n".join(command.check_args(args, 2, torch.device("cpu"), torch.float32))
    assert "positive multiple of 16" in problems
    assert "--reference fsdp2" in problems
    assert "--measured_steps must be at least 1" in problems
    assert "--rounds must be at least 1" in problems
    assert "--attention efficient has no CPU kernel" in problems
    assert "drop --batch_size" in problems
    assert command.check_args(command.parse_args(["--model", "tiny", "--resolution", "32", "--sweep"]), 1, torch.device("cpu"), torch.float32) == []
