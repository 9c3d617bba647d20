"""Prodigy and schedule-free AdamW on 2 CPU processes (gloo) stepping FSDP2's dim-0 shards (even, uneven, and a
rank with none of a tensor) give what 1 process gives stepping the whole tensors, without reading anything on
the host: Prodigy's step-size sums run over every rank in one all-reduce of device values per update."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("optimizer_shards_worker")
    run_processes(2, REPO_ROOT / "tests" / "support" / "optimizer_shards_worker.py", [str(output_dir)])
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_prodigy_on_two_ranks_gives_one_process_step_size_and_weights(reports):
    """The sums over shards add in another order than over whole tensors: equal to fp32 rounding, and the
    same on both ranks (d is all-reduced)."""
    for report in reports:
        result = report["prodigy"]
        assert result["d"] > 1e-4  # grown from 1e-6: the estimate is what is compared
        assert result["d"] == pytest.approx(result["d_one_process"], rel=1e-6)
        assert result["moved"] > 1e-3 and result["max_difference"] <= 1e-6  # an ulp or a few of weights about 1 in size
    assert reports[0]["prodigy"]["d"] == reports[1]["prodigy"]["d"]


def test_schedule_free_on_two_ranks_gives_one_process_weights_bit_for_bit(reports):
    """Every operation is elementwise and its scalars come from the rates alone: the trained and the
    evaluation weights are the same bits as on one process."""
    for report in reports:
        result = report["adamw_schedulefree"]
        assert result["moved"] > 1e-2
        assert result["max_difference"] == 0.0 and result["evaluation_max_difference"] == 0.0


def test_a_sharded_step_reads_nothing_on_the_host_and_prodigy_all_reduces_once(reports):
    for report in reports:
        assert report["prodigy"]["host_reads"] == report["adamw_schedulefree"]["host_reads"] == 0
        assert (report["prodigy"]["all_reduces"], report["adamw_schedulefree"]["all_reduces"]) == (1, 0)
        assert report["prodigy"]["other_collectives"] == report["adamw_schedulefree"]["other_collectives"] == 0
