"""The trainer as users run it, timed from its own log: train.sh on a cache this script builds, one variant
after another, each variant's milliseconds per update read from the run's TensorBoard events, beside the step
benchmark (train_throughput.py) for the same settings; the difference is the time spent outside the step.

    venv/bin/python benchmarks/train_end_to_end.py --json results.json           # a GPU: full-size SDXL, 1024 px
    venv/bin/python benchmarks/train_end_to_end.py --tiny --json results.json    # anywhere: the tiny model, CPU

What it builds (nothing is downloaded): a random-weight pipeline with SDXL's full-size architecture (--tiny:
the tests' tiny one), IMAGES random images with captions at the resolution, and their cache, made by
sdxl_process_data_dir.sh. Then each variant runs `NUM_PROCESSES=1 bash train.sh FLAGS` for UPDATES updates
with validation, samples and the export off, and a state save at SAVE_AT. Per variant it reports:
- ms per update over updates MEASURE_FROM..UPDATES but the save's (the wall time between the train/loss
  events of the updates that log: every LOG_EVERY, the trainer's default cadence, so the host runs ahead
  between logs as in users' runs), and images/s;
- the save's pause: the interval holding the update after the save less as many median updates;
- the GPU's busy share over the measured window (nvidia-smi's utilization, sampled every 100 ms; GPU only);
- the step benchmark's ms per update for the same batch and settings, and the time outside the step.
A variant that fails (a crash, no log) is named and makes the script exit 1 after the others ran.

Variants: --variant NAME=FLAGS, repeatable (FLAGS as train.sh takes them, one string). Default: the setting
diffusers' SDXL example was measured at (batch 4, gradient checkpointing, fp32 weights, bf16 compute,
8-bit AdamW), the same with --compile_unet, and the shipped 24 GB config (configs/1x24gb_bf16.toml); on an
H200 the three take about 9 minutes with their step benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402

from benchmarks.lib.comparison import Measurement, trainer_ms_per_step  # noqa: E402
from benchmarks.lib.images import write_captioned_images  # noqa: E402
from benchmarks.lib.processes import call_in_fresh_process  # noqa: E402
from benchmarks.lib.results import write_json  # noqa: E402
from benchmarks.lib.run_logs import GpuBusy, ms_per_update, update_times  # noqa: E402
from benchmarks.lib.steps import StepSettings  # noqa: E402

EXAMPLE_SETTING = "--train_batch_size 4 --gradient_checkpointing --weights_dtype fp32 --mixed_precision auto --optimizer adamw8bit"
DEFAULT_VARIANTS = {
    "batch4_checkpointing": EXAMPLE_SETTING,
    "batch4_checkpointing_compiled": f"{EXAMPLE_SETTING} --compile_unet",
    "config_1x24gb_bf16": "--config configs/1x24gb_bf16.toml",
}
STEP_MEASUREMENT = Measurement(warmup_steps=2, measured_steps=4)  # as the battery's step parts time it (gpu_check.sh)
RUN_FLAGS = ("--no-validation_loss --no-validation_image --no-save_samples --no-save_diffusers --gradient_accumulation_steps 1 "
             "--dataloader_num_workers 2 --set_seed 0")


@dataclass
class VariantResult:
    name: str
    flags: str
    exit_code: int
    ms_per_update: float | None = None
    images_per_second: float | None = None
    updates_measured: int = 0
    save_pause_s: float | None = None
    gpu_busy_share: float | None = None
    step_ms_per_update: float | None = None  # train_throughput.py, same batch and settings
    outside_step_ms: float | None = None
    failure: str = ""


def make_pipeline(folder: Path, tiny: bool) -> None:
    """A random-weight pipeline: the tests' tiny one, or SDXL's full-size architecture built on the GPU."""
    if tiny:
        from sdxl_trainer.models.tiny import save_tiny_pipeline

        save_tiny_pipeline(folder, seed=0)
        return
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from sdxl_trainer.models.sdxl import SDXL_SCHEDULER_CONFIG, build_full_size_text_encoders, build_full_size_unet, build_full_size_vae, sdxl_tokenizers

    with torch.device("cuda"):
        unet, vae = build_full_size_unet(), build_full_size_vae()
        text_encoder, text_encoder_2 = build_full_size_text_encoders()
    tokenizer, tokenizer_2 = sdxl_tokenizers()
    pipeline = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER_CONFIG),
    ).to(torch.bfloat16)
    pipeline.save_pretrained(folder)


def run_logged(command: list[str], env: dict, log: Path, timeout: float) -> int:
    with open(log, "w") as handle:
        try:
            return subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\n[train_end_to_end] timed out after {timeout:.0f} s\n")
            return 124


def step_benchmark_ms(flags: str, resolution: int, tiny: bool, log: Path) -> float | None:
    """The step benchmark's ms per update (train_throughput.py's trainer path alone) for the variant's batch,
    checkpointing, optimizer, weights, precision and compile setting, in a fresh process; None for a shipped
    config (its batch and settings are the trainer's business) or if it gave no figure (`log` says why)."""
    words = shlex.split(flags)

    def value(flag: str, default: str) -> str:
        return words[words.index(flag) + 1] if flag in words else default

    if "--config" in words and "--train_batch_size" not in words:
        return None
    settings = StepSettings(
        model="tiny" if tiny else "sdxl", resolution=resolution, batch_size=int(value("--train_batch_size", "4")),
        gradient_checkpointing="--no-gradient_checkpointing" not in words, optimizer=value("--optimizer", "adamw8bit"),
        weights_dtype=value("--weights_dtype", "fp32"), compile="--compile_unet" in words,
    )  # fmt: skip
    return call_in_fresh_process(trainer_ms_per_step, settings, value("--mixed_precision", "auto"), STEP_MEASUREMENT, log=log, timeout_s=900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny test pipeline at 256 px on whatever device there is (CPU), for a smoke run")
    parser.add_argument("--images", type=int, default=32, help="images in the cache")
    parser.add_argument("--resolution", type=int, default=None, help="square image side in px (default 1024; 256 with --tiny)")
    parser.add_argument("--updates", type=int, default=40, help="updates per variant (--max_train_updates)")
    parser.add_argument("--measure_from", type=int, default=10, help="updates before the measured window (compiles, allocator warm-up)")
    parser.add_argument("--save_at", type=int, default=20, help="the update after which state is saved once (its pause is reported)")
    parser.add_argument("--log_every", type=int, default=10,
                        help="the runs' --log_every_n_updates (the trainer's default): the log's wall times are read at these updates")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help="a variant to run instead of the defaults (repeatable)")
    parser.add_argument("--step_benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the trainer's step alone per variant (train_throughput.py's trainer path, in a fresh process)")
    parser.add_argument("--work_dir", type=Path, default=None, help="where the pipeline, images, cache and runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write every variant's figures here")
    args = parser.parse_args(argv)
    resolution = args.resolution or (256 if args.tiny else 1024)
    variants = dict(variant.split("=", 1) for variant in args.variant) if args.variant else DEFAULT_VARIANTS
    env = dict(os.environ, NUM_PROCESSES="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    gpu = not args.tiny

    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        work = Path(scratch)
        started = time.perf_counter()
        make_pipeline(work / "pipeline", args.tiny)
        write_captioned_images(work / "images", args.images, resolution)
        print(f"Pipeline and {args.images} images of {resolution} px in {time.perf_counter() - started:.0f} s", flush=True)
        started = time.perf_counter()
        cache_code = run_logged(
            ["bash", "sdxl_process_data_dir.sh", "--data_dir", str(work / "images"), "--cache_dir", str(work / "cache"),
             "--pretrained_model_name_or_path", str(work / "pipeline"), "--min_resolution", str(resolution), "--max_resolution", str(resolution)],
            dict(env, NUM_GPUS="1"), work / "cache.log", timeout=1200,
        )
        if cache_code != 0:
            print((work / "cache.log").read_text()[-3000:])
            print(f"Caching failed (exit {cache_code}): no variant can run.")
            return 1
        print(f"Cached in {time.perf_counter() - started:.0f} s", flush=True)

        results = []
        for name, flags in variants.items():
            run_dir = work / "runs" / name
            command = ["bash", "train.sh", *shlex.split(flags), *shlex.split(RUN_FLAGS), "--cached_dataset_dirs", str(work / "cache"),
                       "--pretrained_model_name_or_path", str(work / "pipeline"), "--max_train_updates", str(args.updates),
                       "--save_state_every_n_updates", str(args.save_at), "--checkpoints_total_limit", "1", "--log_every_n_updates", str(args.log_every),
                       "--output_dir", str(work / "runs"), "--project_name", name]
            print(f"=== {name}: {' '.join(command)}", flush=True)
            with GpuBusy() if gpu else nullcontext() as busy:
                code = run_logged(command, env, work / f"{name}.log", timeout=1800)
            result = VariantResult(name, flags, code)
            try:
                if not (run_dir / "tensorboard").is_dir():
                    raise FileNotFoundError(f"{run_dir / 'tensorboard'} was not written")
                times = update_times(run_dir / "tensorboard")
                timing = ms_per_update(times, args.measure_from, args.save_at)
                result.ms_per_update, result.save_pause_s, result.updates_measured = timing.ms_per_update, timing.save_pause_s, timing.updates_measured
                batch = _images_per_update(run_dir)
                result.images_per_second = batch / result.ms_per_update * 1000
                if busy is not None:
                    result.gpu_busy_share = busy.share(timing.window_start, times[max(times)])
            except (KeyError, ValueError, FileNotFoundError, statistics.StatisticsError) as error:
                result.failure = f"no timing in its log ({type(error).__name__}: {error})"
            if code != 0:
                result.failure = f"exit code {code}: " + _last_lines(work / f"{name}.log")
            if args.step_benchmark and not result.failure:
                step_log = work / f"{name}_step.log"
                result.step_ms_per_update = step_benchmark_ms(flags, resolution, args.tiny, step_log)
                if result.step_ms_per_update is not None:
                    result.outside_step_ms = result.ms_per_update - result.step_ms_per_update
                elif step_log.exists():
                    print(f"{name}: the step benchmark gave no figure: {_last_lines(step_log)}", flush=True)
            results.append(result)
            print(describe(result), flush=True)

    failed = [result.name for result in results if result.failure]
    print("\n| variant | ms/update | img/s | step ms (train_throughput) | outside the step, ms | GPU busy | save pause, s |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(f"| {result.name} | {_number(result.ms_per_update)} | {_number(result.images_per_second, 2)} | {_number(result.step_ms_per_update)} | "
              f"{_number(result.outside_step_ms)} | {_number(result.gpu_busy_share and 100 * result.gpu_busy_share)}% | {_number(result.save_pause_s, 1)} |")
    if args.json:
        figures = {"resolution": resolution, "tiny": args.tiny, "updates": args.updates, "measure_from": args.measure_from, "log_every": args.log_every,
                   "variants": [asdict(result) for result in results]}  # fmt: skip
        write_json(args.json, figures, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


def _images_per_update(run_dir: Path) -> int:
    config = json.loads((run_dir / "config.json").read_text())
    return config["train_batch_size"] * config["gradient_accumulation_steps"]


def _last_lines(log: Path, count: int = 3) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " / ".join(lines[-count:])


def _number(value: float | None, decimals: int = 0) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def describe(result: VariantResult) -> str:
    if result.failure:
        return f"{result.name}: FAILED, {result.failure}"
    return (f"{result.name}: {result.ms_per_update:.0f} ms per update ({result.images_per_second:.2f} img/s) over {result.updates_measured} updates"
            + (f", step alone {result.step_ms_per_update:.0f} ms" if result.step_ms_per_update else "")
            + (f", save pause {result.save_pause_s:.1f} s" if result.save_pause_s is not None else ""))


if __name__ == "__main__":
    sys.exit(main())
