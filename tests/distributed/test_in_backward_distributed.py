"""--optimizer_in_backward over FSDP2 shards on 2 CPU processes (gloo): FSDP2 calls each sharded parameter's
post-accumulate-grad hook after its unit's reduce-scatter, where the unit is stepped and its gradients freed."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, run_processes

from sdxl_trainer.optimizers.build import IN_BACKWARD_REFUSED, OPTIMIZERS

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_pipeline_dir) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("in_backward_worker")
    run_processes(2, REPO_ROOT / "tests" / "support" / "in_backward_worker.py", [str(tiny_pipeline_dir), str(output_dir)])
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", [name for name in OPTIMIZERS if name not in IN_BACKWARD_REFUSED])
def test_in_backward_on_two_ranks_gives_the_ordinary_weights_frees_gradients_and_resumes_exactly(reports, name):
    for report in reports:
        result = report[name]
        assert result["against_ordinary"] == 0.0, f"{name}: differs from the ordinary step by {result['against_ordinary']}"
        assert result["losses"] == result["ordinary_losses"]
        assert result["resumed_against_straight"] == 0.0, f"{name}: resumed update differs by {result['resumed_against_straight']}"
        assert not result["grads_left"]
        # The ordinary step ends backward holding a gradient shard as large as the weight shards.
        assert 0 < result["peak_grad_bytes"] < result["local_param_bytes"] / 2, (result["peak_grad_bytes"], result["local_param_bytes"])
    assert reports[0][name]["losses"] == reports[1][name]["losses"]  # all-reduced before backward
