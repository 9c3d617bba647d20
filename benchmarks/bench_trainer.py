"""Trainer overhead on CPU with the tiny SDXL: the trainer's update path next to a hand-written loop doing
the same forward/backward/clip/step on the same batches, in the same run, on 1 and on 2 processes.

    venv/bin/python benchmarks/bench_trainer.py [--updates_per_round 6] [--rounds 3] [--processes 1 2] [--sessions 2]

The trainer path is what sdxl_FSDP_train.py runs per update: the UNet as prepare_unet leaves it (plain on
one process, FSDP2-sharded on two), DataLoader over the cache (2 workers), TrainStep (per-sample seeded
noise/timesteps/dropout, accumulation, loss all-reduce, clipping, finite check, optimizer, LR schedule) and
the per-update logging (peak memory gathered from every rank, TensorBoard). The reference loop gets its
batches already in memory and draws noise from the global RNG:
- 1 process: a plain loop over an unsharded UNet (target: trainer / plain <= 1.05); the trainer as it ran
  before prepare_unet (TrainStep over an FSDP2-sharded UNet) is measured beside them;
- 2 processes: a minimal FSDP2 loop over the trainer's own sharded UNet (target: overhead under 5%).
Every path has the same optimizer (torchao AdamW8bit), precision (fp32) and gradient checkpointing; the
paths alternate in rounds so machine noise hits them alike. Data loading should stay under 2% of an update.

Each process count runs side by side under glibc's default allocator settings and under the thresholds
train.sh sets (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, read from tools/allocator_settings.sh), alternating for
--sessions sessions of each; besides the time, the training process's CPU time (all its threads) and minor
page faults (heap handed back to the OS and faulted in again) per update are counted. Processes start as train.sh starts them:
python directly for one, the launcher for two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

PER_RANK_BATCH = 2
SEED = 11


def worker(pipeline_dir: Path, cache_dir: Path, output_dir: Path, updates_per_round: int, rounds: int) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from torch.utils.data import DataLoader

    from sdxl_trainer.cache.reader import read_empty_prompt
    from sdxl_trainer.distributed.fsdp import prepare_unet, shard_unet
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed
    from sdxl_trainer.monitoring.memory_peaks import gather_floats, peak_memory_gib
    from sdxl_trainer.monitoring.metrics_writer import MetricsWriter
    from sdxl_trainer.monitoring.throughput import Throughput
    from sdxl_trainer.optimizers.build import build_optimizer
    from sdxl_trainer.training.dataset import CachedDataset, collate
    from sdxl_trainer.training.epochs import EpochPlanner, rank_slice
    from sdxl_trainer.training.loss import build_noise_scheduler
    from sdxl_trainer.training.lr_schedule import LearningRateSchedule
    from sdxl_trainer.training.noise_settings import NoiseSettings
    from sdxl_trainer.training.step import TrainStep

    world = init_distributed()
    dataset = CachedDataset([cache_dir])
    planner = EpochPlanner(dataset.bucket_ids(), np.arange(len(dataset)), PER_RANK_BATCH * world.world_size, 1, SEED)
    plan_batches = [batch for plan in planner.plans(40) for batch in plan.batches]
    warmup = 2
    needed = warmup + updates_per_round * rounds
    rank_batches = [rank_slice(batch, world.rank, PER_RANK_BATCH) for batch in plan_batches[:needed]]
    assert len(rank_batches) == needed, "not enough batches in the cache for this many updates"
    in_memory = [collate([dataset[index] for index in batch]) for batch in rank_batches]
    noise_scheduler = build_noise_scheduler(str(pipeline_dir), "epsilon", zero_terminal_snr=False)
    empty_prompt = read_empty_prompt(cache_dir)
    metrics = MetricsWriter(output_dir / "tensorboard", enabled=world.is_main)

    def new_unet(layout: str):
        unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
        unet.enable_gradient_checkpointing()
        unet.train()
        if layout == "trainer":
            prepare_unet(unet, world, param_dtype=None)
        elif layout == "fsdp2":
            shard_unet(unet, world.mesh, param_dtype=None)
        return unet, build_optimizer("adamw8bit", unet.parameters(), 1e-5, 1e-2, (0.9, 0.999), 1e-8)

    def trainer_path(unet, optimizer):
        step = TrainStep(unet, optimizer, LearningRateSchedule("constant", 1e-5, 0, 1), noise_scheduler, NoiseSettings(0.1), empty_prompt, SEED, max_grad_norm=1.0)
        loader = iter(DataLoader(dataset, batch_sampler=rank_batches, num_workers=2, collate_fn=collate))
        throughput = Throughput()

        def update(index: int) -> float:
            started = time.perf_counter()
            throughput.start()
            batch = next(loader)
            throughput.data_ready()
            result = step([batch], epoch=0)
            throughput.stop(PER_RANK_BATCH * world.world_size)
            memory = gather_floats(peak_memory_gib(world.device), world.device)
            metrics.scalars({"train/loss": result.loss, "train/lr": result.learning_rate, **{f"m/{r}": m for r, m in enumerate(memory)}}, index)
            return time.perf_counter() - started

        return update, throughput

    def reference_path(unet, optimizer):
        def update(index: int) -> float:
            started = time.perf_counter()
            batch = in_memory[index]
            latents = batch["latents"].float()
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, 1000, (latents.shape[0],))
            prediction = unet(
                noise_scheduler.add_noise(latents, noise, timesteps),
                timesteps,
                encoder_hidden_states=batch["prompt_embeds"].float(),
                added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"].float(), "time_ids": batch["time_ids"]},
            ).sample
            F.mse_loss(prediction, noise).backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - started

        return update

    trainer_update, throughput = trainer_path(*new_unet("trainer"))
    paths = {"trainer": trainer_update}
    if world.world_size == 1:
        paths["trainer over FSDP2"] = trainer_path(*new_unet("fsdp2"))[0]
        paths["plain loop"] = reference_path(*new_unet("plain"))
    else:
        paths["minimal FSDP2 loop"] = reference_path(*new_unet("fsdp2"))
    for index in range(warmup):  # compiles torchao's step, warms the allocator and the loader
        for run in paths.values():
            run(index)
    times: dict[str, list[float]] = {name: [] for name in paths}
    faults: dict[str, list[int]] = {name: [] for name in paths}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in paths}  # all threads of the process: less exposed to a busy machine
    data_seconds_before, seconds_before = throughput.data_seconds, throughput.seconds
    index = warmup
    for _ in range(rounds):
        for name, run in paths.items():
            for offset in range(updates_per_round):
                faults_before, cpu_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                times[name].append(run(index + offset))
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
                cpu_seconds[name].append(time.process_time() - cpu_before)
        index += updates_per_round
    data_share = (throughput.data_seconds - data_seconds_before) / (throughput.seconds - seconds_before)
    if world.is_main:
        (output_dir / f"times_{world.world_size}.json").write_text(json.dumps({"times": times, "faults": faults, "cpu_seconds": cpu_seconds, "data_share": data_share}))
    metrics.close()
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates_per_round", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--sessions", type=int, default=2, help="runs under each allocator setting, alternating")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*map(Path, args.worker), args.updates_per_round, args.rounds)
        return

    import numpy as np

    from sdxl_trainer.config import parse_config
    from sdxl_trainer.distributed.world import free_port
    from sdxl_trainer.jobs.cache_config import CacheConfig
    from sdxl_trainer.jobs.cache_job import run_caching
    from sdxl_trainer.models.tiny import save_tiny_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        pipeline_dir = save_tiny_pipeline(Path(tmp) / "tiny_sdxl", seed=0)
        cache_dir = Path(tmp) / "cache"
        run_caching(parse_config(CacheConfig, [
            "--data_dir", str(REPO_ROOT / "sample_dataset"), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline_dir),
            "--min_resolution", "256", "--max_resolution", "512",
        ]))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO_ROOT))
        glibc_defaults = {name: value for name, value in env.items() if not name.startswith("MALLOC_")}
        allocators = {"glibc defaults": glibc_defaults, "train.sh's thresholds": dict(glibc_defaults, **train_sh_allocator_settings())}
        reports: dict[tuple[int, str], list[dict]] = {}
        for processes in args.processes:
            launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "sdxl_trainer.distributed.launcher", "--nproc_per_node", str(processes), "--master_port", str(free_port())]
            command = [*launch, __file__, "--updates_per_round", str(args.updates_per_round), "--rounds", str(args.rounds), "--worker", str(pipeline_dir), str(cache_dir), tmp]
            for _ in range(args.sessions):
                for allocator, allocator_env in allocators.items():
                    subprocess.run(command, check=True, env=allocator_env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
                    reports.setdefault((processes, allocator), []).append(json.loads((Path(tmp) / f"times_{processes}.json").read_text()))
    print(f"train.sh's allocator settings: {' '.join(f'{name}={value}' for name, value in train_sh_allocator_settings().items())}")
    for (processes, allocator), sessions in reports.items():
        times = {name: np.concatenate([session["times"][name] for session in sessions]) for name in sessions[0]["times"]}
        faults = {name: np.concatenate([session["faults"][name] for session in sessions]) for name in sessions[0]["faults"]}
        cpu_seconds = {name: np.concatenate([session["cpu_seconds"][name] for session in sessions]) for name in sessions[0]["cpu_seconds"]}
        reference = "plain loop" if processes == 1 else "minimal FSDP2 loop"
        print(f"{processes} CPU process(es), {allocator}, tiny SDXL UNet, batch {PER_RANK_BATCH} per process, torchao AdamW8bit, fp32, "
              f"gradient checkpointing; {len(sessions)} sessions")
        for name, values in times.items():
            print(f"  {name:20s}: {values.mean() * 1000:7.1f} ms/update (median {np.median(values) * 1000:.1f}), "
                  f"CPU {np.median(cpu_seconds[name]) * 1000:7.1f} ms/update (median), {np.median(faults[name]):6.0f} minor page faults/update (median)")
        for name, values in times.items():
            if name != reference:
                print(f"  {name} / {reference}: {values.mean() / times[reference].mean():.3f} (mean), "
                      f"{np.median(values) / np.median(times[reference]):.3f} (median)")
        data_share = np.mean([session["data_share"] for session in sessions])
        print(f"  data loading: {data_share * 100:.2f}% of the trainer's update time")


def train_sh_allocator_settings() -> dict[str, str]:
    """The MALLOC_*_ defaults train.sh exports (`export MALLOC_X_=${MALLOC_X_:-value}` in tools/allocator_settings.sh), so this
    measures them as set."""
    settings = dict(re.findall(r"(MALLOC_\w+_)=\$\{\1:-(\d+)\}", (REPO_ROOT / "tools" / "allocator_settings.sh").read_text()))
    assert settings, "tools/allocator_settings.sh sets no MALLOC_*_ thresholds"
    return settings


if __name__ == "__main__":
    main()
