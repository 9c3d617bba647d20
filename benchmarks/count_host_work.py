"""The host's work per update, counted on a CPU: what paces an update when the GPU waits for Python.

    venv/bin/python benchmarks/count_host_work.py [--variants eager_1 eager_2 bf16_1 ...] [--json OUT]

The trainer itself runs (sdxl_FSDP_train.py's config, build and loop: data stream, TrainStep, monitor, stop
agreement, checkpointer) on SDXL's UNet at a narrow width (models/sdxl.py NARROW_SDXL_UNET_CONFIG: every
block, layer and parameter tensor of the published architecture, 1,680 tensors) dropped into the tests'
tiny pipeline, on sample_dataset/ cached at 256-320 px, 8-bit AdamW, EMA, gradient checkpointing, batch 2 x
2 microbatches per rank, a log every 3 updates. What it counts does not depend on the width: operators
dispatched outside compiled regions (the stand-in for kernel launches; the most dispatched by name too), host
reads, and collectives by kind and process group (their bytes at full size: --estimate_speed). The exception
is the optimizer's part, which is per chunk of up to 16 M values: the narrow UNet fills 2-3 of them, so the
chunks the full-size UNet makes are printed beside it. Each update is counted from its step's start to the next one's, so its data fetch,
logging, stop agreement and checkpointer's turn are in it; the first update (kernels compiled, the
optimizer's state made) and the last are left out.

Variants: eager or --compile_unet, on 1 process or 2 (FSDP2 over gloo, as train.sh runs it on a CPU), in fp32
as a CPU computes; and in bf16 as GPUs compute: bf16_1 over fp32 weights on one process (torch.autocast),
bf16_weights_1 over bf16 weights (--weights_dtype bf16), bf16_weights_lion_1 the same with Lion (an
optimizer with fp32 moments, whose rounding is its own code), bf16_2 in FSDP2's bf16 param dtype on two.
adafactor_1 and came_1 are eager_1 with Adafactor and with CAME, which step runs of same-shaped tensors (up to 16 M
values each): the narrow UNet makes one per shape, so the runs the full-size UNet makes are printed too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.lib.processes import cpu_env, launch_command  # noqa: E402
from benchmarks.lib.results import write_json  # noqa: E402

UPDATES = 8
LOG_EVERY = 3
OPERATORS_SHOWN = 12
VARIANTS = {
    "eager_1": (1, ()), "compile_1": (1, ("--compile_unet",)), "eager_2": (2, ()), "compile_2": (2, ("--compile_unet",)),
    # One GPU's precision over fp32 weights (torch.autocast in bf16, as on an H200), counted on the CPU.
    "bf16_1": (1, ("--mixed_precision", "bf16")),
    "bf16_weights_1": (1, ("--weights_dtype", "bf16")),  # the same compute over bf16 weights: nothing to cast
    "bf16_weights_lion_1": (1, ("--weights_dtype", "bf16", "--optimizer", "lion")),  # rounding in an fp32-moment optimizer
    "bf16_2": (2, ("--mixed_precision", "bf16")),  # FSDP2's bf16 param dtype, as several GPUs run
    "adafactor_1": (1, ("--optimizer", "adafactor")),  # an optimizer that steps runs of same-shaped tensors (its factored moments)
    "came_1": (1, ("--optimizer", "came")),  # Adafactor's factored moments with a momentum and its factored confidence
}  # fmt: skip


def narrow_pipeline(work_dir: Path) -> Path:
    """The tiny pipeline with SDXL's UNet at a narrow width (its text encoders and VAE fit the narrow UNet)."""
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.models.sdxl import NARROW_SDXL_UNET_CONFIG
    from sdxl_trainer.models.tiny import save_tiny_pipeline

    folder = work_dir / "narrow_sdxl"
    if not (folder / "model_index.json").is_file():
        save_tiny_pipeline(folder, seed=0)
        shutil.rmtree(folder / "unet")
        UNet2DConditionModel(**NARROW_SDXL_UNET_CONFIG).save_pretrained(folder / "unet")
    return folder


def sample_cache(work_dir: Path, pipeline: Path) -> Path:
    cache = work_dir / "sample_cache"
    if not (cache / "cache_info.json").is_file():
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "sdxl_process_data_dir.py"), "--data_dir", str(REPO_ROOT / "sample_dataset"), "--cache_dir", str(cache),
             "--pretrained_model_name_or_path", str(pipeline), "--min_resolution", "256", "--max_resolution", "320"],
            check=True, cwd=REPO_ROOT,
        )  # fmt: skip
    return cache


def factored_runs(unet_config: dict, ranks: int) -> int:
    """The runs of same-shaped tensors that Adafactor and CAME step on rank 0 over a UNet of `unet_config` sharded
    over `ranks` (speed_estimate.factored_step_runs, the step's own rule), worked out on the meta device: their
    host work is per run, and the narrow UNet's tensors fill one run per shape."""
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.estimates.speed_estimate import factored_step_runs

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
    return len(factored_step_runs([tuple(param.shape) for param in unet.parameters()], ranks))


def optimizer_chunks(unet_config: dict, ranks: int) -> int:
    """The chunks rank 0's 8-bit AdamW step makes over a UNet of `unet_config` sharded over `ranks` (FSDP2's dim-0
    shards, the step's rule for 8-bit moments and its CHUNK_VALUES), worked out on the meta device. The step's
    host work is per chunk, and the narrow UNet's values fill only a few: the full-size UNet's chunks say what its
    count means at full size."""
    from diffusers import UNet2DConditionModel

    from sdxl_trainer.optimizers.adamw8bit import BLOCK_SIZE, CHUNK_VALUES
    from sdxl_trainer.optimizers.shards import runs_of_at_most

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
    sizes_by_kind: dict[bool, list[int]] = {True: [], False: []}
    for param in unet.parameters():
        rows = -(-param.shape[0] // ranks)
        size = rows * (param.numel() // param.shape[0])
        sizes_by_kind[size >= 4096 and size % BLOCK_SIZE == 0].append(size)
    return sum(len(list(runs_of_at_most(sizes, sizes, CHUNK_VALUES))) for sizes in sizes_by_kind.values())


def trainer_flags(pipeline: Path, cache: Path, output_dir: Path, extra: tuple[str, ...]) -> list[str]:
    optimizer = () if "--optimizer" in extra else ("--optimizer", "adamw8bit")
    return [
        "--pretrained_model_name_or_path", str(pipeline), "--cached_dataset_dirs", str(cache), "--output_dir", str(output_dir),
        "--project_name", "counted", "--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_train_updates", str(UPDATES),
        "--log_every_n_updates", str(LOG_EVERY), "--use_ema", *optimizer, "--no-validation_loss", "--no-validation_image",
        "--no-save_samples", "--no-save_diffusers", "--no-save_state", "--overwrite_run", "--set_seed", "1", *extra,
    ]  # fmt: skip


def rank_main(flags: list[str], output: Path) -> None:
    """One rank of a counted run: the trainer's own build and loop, its step counted."""
    import torch.distributed as dist

    from sdxl_trainer.config import parse_config
    from sdxl_trainer.distributed.stop_request import StopRequest
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
    from sdxl_trainer.estimates.host_work import CountedEveryUpdate
    from sdxl_trainer.jobs.train_build import build_run
    from sdxl_trainer.jobs.train_config import TrainConfig
    from sdxl_trainer.jobs.train_loop import run_loop

    config = parse_config(TrainConfig, flags)
    world = init_distributed(config.replicate_groups)
    run = build_run(config, world, StopRequest(announce=False))
    counted = CountedEveryUpdate(run.train_step)
    run.train_step = counted
    try:
        run_loop(run)
    finally:
        counted.close()
        run.close()
    groups = {dist.group.WORLD.group_name: "world", run.monitor.host_group.group_name: "host (gloo)"}
    updates = []
    for number, counts in enumerate(counted.updates[1:-1], start=2):  # the first compiles; the last ends the run
        updates.append({
            "update": number,
            "logs": number % LOG_EVERY == 0,
            "ops": dict(counts.ops),
            "operators": dict(counts.operators.most_common()),
            "reads": {f"{file}:{function}": count for (file, function), count in counts.reads.items()},
            "collectives": {f"{kind} over {groups.get(group, group)}": [count, counts.collective_bytes[(kind, group)]]
                            for (kind, group), count in counts.collective_calls.items()},
        })  # fmt: skip
    if world.is_main:
        output.write_text(json.dumps(updates, indent=1))
    shutdown_distributed()


def run_variant(name: str, pipeline: Path, cache: Path, work_dir: Path) -> list[dict]:
    processes, extra = VARIANTS[name]
    output = work_dir / f"{name}.json"
    output.unlink(missing_ok=True)
    args = ["--rank_program", str(output), "--", *trainer_flags(pipeline, cache, work_dir / name, extra)]
    subprocess.run(launch_command(processes, REPO_ROOT / "benchmarks" / "count_host_work.py", args), check=True, cwd=REPO_ROOT, env=cpu_env())
    return json.loads(output.read_text())


def summary(updates: list[dict]) -> dict[str, dict]:
    """Per kind of update (one that logs, one that ends an epoch, which writes the epoch's loss, and one that
    does neither): the counts of the last such update counted."""
    kinds = {}
    for update in updates:
        if update["logs"]:
            kinds["an update that logs"] = update
        elif update["ops"].get("logging"):
            kinds["an update that ends an epoch"] = update
        else:
            kinds["an update that does not log"] = update
    return kinds


def print_table(results: dict[str, list[dict]]) -> None:
    parts = sorted({part for updates in results.values() for update in updates for part in update["ops"]})
    for name, updates in results.items():
        for kind, update in summary(updates).items():
            ops = Counter(update["ops"])
            print(f"\n{name}, {kind} (update {update['update']}): {sum(ops.values())} operators dispatched, "
                  f"{sum(update['reads'].values())} host reads")  # fmt: skip
            print("  operators by part: " + ", ".join(f"{part} {ops[part]}" for part in parts if ops[part]))
            print("  most dispatched: " + ", ".join(f"{operator} {count}" for operator, count in list(update["operators"].items())[:OPERATORS_SHOWN]))
            if update["reads"]:
                print("  host reads: " + ", ".join(f"{place} x{count}" for place, count in sorted(update["reads"].items())))
            for collective, (calls, size) in sorted(update["collectives"].items()):
                print(f"  {collective}: {calls} calls, {size} bytes (narrow width)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/sdxl_host_work"), help="the narrow pipeline, its cache and the runs (kept for reruns)")
    parser.add_argument("--json", type=Path, help="write every counted update of every variant here, with the run's facts (date, machine, commit)")
    parser.add_argument("--rank_program", type=Path, help=argparse.SUPPRESS)  # one rank of a counted run (run_variant starts it)
    args, trainer_args = parser.parse_known_args(argv)
    if args.rank_program is not None:
        rank_main([arg for arg in trainer_args if arg != "--"], args.rank_program)
        return 0
    args.work_dir.mkdir(parents=True, exist_ok=True)
    pipeline = narrow_pipeline(args.work_dir)
    cache = sample_cache(args.work_dir, pipeline)
    results = {name: run_variant(name, pipeline, cache, args.work_dir) for name in args.variants}
    print_table(results)
    from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG

    full_size_chunks = {ranks: optimizer_chunks(SDXL_UNET_CONFIG, ranks) for ranks in (1, 2, 8)}
    print("\n8-bit AdamW's chunks on rank 0 at full size (1, 2, 8 ranks): " + ", ".join(map(str, full_size_chunks.values())))
    full_size_runs = {ranks: factored_runs(SDXL_UNET_CONFIG, ranks) for ranks in (1, 2, 8)}
    print("Adafactor's and CAME's runs of same-shaped tensors on rank 0 at full size (1, 2, 8 ranks): " + ", ".join(map(str, full_size_runs.values())))
    if args.json:
        facts = {"variants": results, "full_size_optimizer_chunks": full_size_chunks, "full_size_factored_runs": full_size_runs}
        write_json(args.json, facts, torch.device("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
