"""Does each shipped config fit the card it is named for? The memory estimate (--estimate_memory, fake
tensors on a CPU) next to the same two updates run for real on one GPU, capped at that card's size.

    # on any machine (a few minutes per config on a CPU): the estimates, written for the GPU run to compare with
    venv/bin/python benchmarks/gpu_memory_check.py --estimate --output benchmarks/results/memory_estimates.json
    # on one GPU (benchmarks/gpu_check.sh runs it): measured peaks next to those estimates
    venv/bin/python benchmarks/gpu_memory_check.py --measure --estimates benchmarks/results/memory_estimates.json \
        --output benchmarks/results/DATE-GPU-memory.json

A config `configs/<gpus>x<card>gb_*.toml` is for GPUs of <card> GB; its per-GPU load is the one
--estimate_memory judges for that card (memory_settings: with --gradient_reduction auto, every microbatch
under 40 GB). One GPU holds what one GPU of a sharded run holds: a fake process group of the config's GPU
count (collectives move nothing), so a 32-GPU config's shard of the weights, gradients and optimizer state
is 1/32, as on each of its GPUs. Gathered weights are then not real ones, so such an update may be skipped
as non-finite: the row says so, and its optimizer step's temporaries (small: the 8-bit step runs in chunks)
are missing from the peak. The cap is torch.cuda.set_per_process_memory_fraction at the card's size, so a
config that does not fit runs out of memory here as it would there (less what the card's driver keeps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402

from benchmarks.lib.results import write_json  # noqa: E402

from sdxl_trainer.config import parse_config  # noqa: E402
from sdxl_trainer.distributed.world import use_expandable_segments, use_rank_own_compile_cache  # noqa: E402
from sdxl_trainer.estimates.fake_run import EstimateSettings
from sdxl_trainer.estimates.measured_memory import measure_memory
from sdxl_trainer.estimates.memory_estimate import GIB, estimate_memory
from sdxl_trainer.jobs.train_config import TrainConfig, memory_settings  # noqa: E402

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.toml"))
LARGE_CARD_GIB = 40  # --gradient_reduction auto: cards from this size reduce once per update


def card_gib(config_path: Path) -> int:
    """The card size a shipped config is named for: configs/2x24gb_consumer.toml -> 24."""
    match = re.search(r"(\d+)gb", config_path.stem)
    if match is None:
        raise SystemExit(f"{config_path.name}: name shipped configs <gpus>x<card>gb_<purpose>.toml so the check knows the card")
    return int(match.group(1))


def load_for_card(config_path: Path) -> EstimateSettings:
    config = parse_config(TrainConfig, ["--config", str(config_path), "--estimate_memory"])
    loads = memory_settings(config)
    if len(loads) == 1:
        return loads[0]
    return next(load for load in loads if load.reduce_every_microbatch == (card_gib(config_path) < LARGE_CARD_GIB))


def describe(settings: EstimateSettings) -> dict:
    """The settings as recorded beside an estimate. --optimizer_in_backward and --block_lr are recorded only when
    given: every estimate recorded before they existed was made without them, which their absence means."""
    described = {
        name: str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        for name, value in dataclasses.asdict(settings).items()
    }
    for name, unset in (("optimizer_in_backward", False), ("block_lr", None)):
        if described[name] == unset:
            del described[name]
    return described


def estimate_all() -> list[dict]:
    rows = []
    for config_path in CONFIGS:
        settings = load_for_card(config_path)
        started = time.perf_counter()
        estimate = estimate_memory(settings)
        print(f"{config_path.name} ({time.perf_counter() - started:.0f} s):\n{estimate.report()}", flush=True)
        rows.append(
            {
                "config": config_path.name,
                "card_gib": card_gib(config_path),
                "settings": describe(settings),
                "estimated_tracked_gib": estimate.gpu_peak / GIB,
                "estimated_with_margin_gib": estimate.gpu_needed_gib,
                "estimated_by_category_gib": {name: size / GIB for name, size in estimate.gpu_peak_by_category.items()},
                "estimated_fits": estimate.fits(card_gib(config_path)),
            }
        )
    return rows


def measure_all(estimates: dict[str, dict]) -> list[dict]:
    device = torch.device("cuda", 0)
    rows = []
    for config_path in CONFIGS:
        settings, card = load_for_card(config_path), card_gib(config_path)
        row = dict(estimates.get(config_path.name, {"config": config_path.name, "card_gib": card, "settings": describe(settings)}))
        started = time.perf_counter()
        try:
            measured = measure_memory(settings, device, cap_gib=card)
        except Exception as error:  # noqa: BLE001 - one config's failure must not hide the others' figures
            row["error"] = f"{type(error).__name__}: {error}"
            print(f"{config_path.name}: failed: {row['error']}", flush=True)
            rows.append(row)
            continue
        row.update(
            measured_allocated_gib=measured.peak_allocated / GIB,
            measured_reserved_gib=measured.peak_reserved / GIB,
            measured_out_of_memory=measured.out_of_memory,
            measured_update_stepped=measured.stepped,
            measured_update_seconds=measured.update_seconds,
            measured_seconds=time.perf_counter() - started,
        )
        if "estimated_tracked_gib" in row:
            row["measured_over_estimated"] = row["measured_allocated_gib"] / row["estimated_tracked_gib"]
        fit = "OUT OF MEMORY" if measured.out_of_memory else f"fits, a whole update (accumulation {min(settings.gradient_accumulation_steps, 2)}) took {measured.update_seconds:.2f} s"
        print(
            f"{config_path.name} capped at {card} GiB: {fit}; peak allocated {row['measured_allocated_gib']:.2f} GiB, reserved "
            f"{row['measured_reserved_gib']:.2f} GiB; estimated {row.get('estimated_tracked_gib', float('nan')):.2f} tracked, "
            f"{row.get('estimated_with_margin_gib', float('nan')):.2f} with margin"
            + ("" if measured.stepped else " (second update skipped as non-finite: its optimizer step is not in the peak)"),
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--estimate", action="store_true", help="estimate every shipped config on fake tensors (no GPU needed)")
    mode.add_argument("--measure", action="store_true", help="run every shipped config's per-GPU load on this machine's first GPU")
    parser.add_argument("--estimates", type=Path, help="with --measure: the JSON --estimate wrote, to put next to the measured figures")
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write the rows to")
    args = parser.parse_args(argv)
    if args.measure:
        if not torch.cuda.is_available():
            raise SystemExit("--measure needs a GPU: run --estimate on a machine without one")
        # As the trainer runs one process: expandable segments (set before CUDA's allocator starts), and its compile cache.
        use_expandable_segments()
        use_rank_own_compile_cache(rank=0, world_size=1)
        estimates = {row["config"]: row for row in json.loads(args.estimates.read_text())["rows"]} if args.estimates else {}
        rows = measure_all(estimates)
        write_json(args.output, {"rows": rows}, torch.device("cuda", 0))
    else:
        write_json(args.output, {"device": "none (fake tensors on the CPU)", "rows": estimate_all()}, torch.device("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
