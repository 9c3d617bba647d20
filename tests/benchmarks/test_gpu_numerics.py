"""CPU smoke test of benchmarks/gpu_numerics.py on the tiny SDXL UNet: each precision trains the same start on
the same draws with the trainer's step, next to fp32 (fp16 only on a GPU)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes


@pytest.mark.multiprocess
def test_numerics_compare_each_precision_with_fp32(tmp_path):
    """The same start and draws in every precision: bf16 rounding shows in the losses and the update."""
    output = tmp_path / "numerics.json"
    result = run_processes(1, REPO_ROOT / "benchmarks" / "gpu_numerics.py",
                  ["--model", "tiny", "--resolution", "32", "--updates", "2", "--optimizer", "adamw", "--output", str(output)], timeout=300)
    rows = {row["precision"]: row for row in json.loads(output.read_text())["rows"]}
    assert list(rows) == ["fp32", "bf16", "bf16 weights"]
    assert rows["fp32"]["weight_change_error"] == rows["fp32"]["max_loss_difference"] == 0.0
    for precision in ("bf16", "bf16 weights"):
        row = rows[precision]
        assert len(row["losses"]) == 2
        assert 0 < row["max_loss_difference"] < 0.02, row  # same start and noise: bf16 rounding only
        assert row["weight_change_error"] > 0.01, row  # rounding shows in the update
    # bf16 weights move by whole bf16 steps (stochastic rounding), far from fp32's small update per weight.
    assert rows["bf16 weights"]["weight_change_error"] > rows["bf16"]["weight_change_error"]
    assert "largest loss difference" in result.stdout


@pytest.mark.multiprocess
def test_a_bf16_gradient_reduction_drifts_less_than_bf16_compute(tmp_path):
    """--reduce_dtype bf16 on 2 processes, each training its own items: the reduce-scatter rounds the summed
    gradients to bf16, which moves the update a little from bf16 compute's with fp32 reduction, and less than
    bf16 compute moves it from fp32's. The losses stay as close to fp32's as bf16's are."""
    output = tmp_path / "numerics.json"
    run_processes(2, REPO_ROOT / "benchmarks" / "gpu_numerics.py",
                  ["--model", "tiny", "--resolution", "32", "--updates", "4", "--optimizer", "adamw", "--output", str(output)], timeout=600)  # fmt: skip
    rows = {row["precision"]: row for row in json.loads(output.read_text())["rows"]}
    assert list(rows) == ["fp32", "bf16", "bf16 weights", "bf16 reduce"]
    reduced, computed = rows["bf16 reduce"], rows["bf16"]
    assert 0 < reduced["weight_change_error_vs_bf16"] < computed["weight_change_error"] / 4, (reduced, computed)
    assert reduced["weight_change_error"] == pytest.approx(computed["weight_change_error"], rel=0.1)
    assert reduced["max_loss_difference"] < 0.01
