"""Trainer overhead on CPU with the tiny SDXL: the trainer's update path next to a minimal hand-written
FSDP2 loop doing the same forward/backward/clip/step on the same batches, in the same run, on 2 processes.

    venv/bin/python benchmarks/bench_trainer.py [--updates_per_round 6] [--rounds 3]

The trainer path is what sdxl_FSDP_train.py runs per update: DataLoader over the cache (2 workers),
TrainStep (per-sample seeded noise/timesteps/dropout, accumulation, loss all-reduce, clipping, finite
check, optimizer, LR schedule) and the per-update logging (peak memory gathered from every rank, TensorBoard).
The minimal loop gets its batches already in memory and draws noise from the global RNG. The two paths
alternate in rounds so machine noise hits both alike. Targets (issue 4): overhead under 5%, data loading
under 2% of the update time.
"""

from __future__ import annotations

import argparse
import json
import os
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

    from sdxl_trainer.cache import read_empty_prompt
    from sdxl_trainer.data import CachedDataset, EpochPlanner, collate, rank_slice
    from sdxl_trainer.diffusion import NoiseSettings, build_noise_scheduler
    from sdxl_trainer.monitor import MetricsWriter, Throughput, gather_floats, peak_memory_gib
    from sdxl_trainer.optimizers import build_optimizer
    from sdxl_trainer.parallel import init_distributed, shard_unet, shutdown_distributed
    from sdxl_trainer.lr_schedule import LearningRateSchedule
    from sdxl_trainer.train_step import TrainStep

    world = init_distributed()
    dataset = CachedDataset([cache_dir])
    planner = EpochPlanner(dataset.bucket_ids(), np.arange(len(dataset)), PER_RANK_BATCH * world.world_size, 1, SEED)
    plan_batches = [batch for plan in planner.plans(20) for batch in plan.batches]
    warmup = 2
    needed = warmup + updates_per_round * rounds
    rank_batches = [rank_slice(batch, world.rank, PER_RANK_BATCH) for batch in plan_batches[:needed]]
    assert len(rank_batches) == needed, "not enough batches in the cache for this many updates"

    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet")
    unet.enable_gradient_checkpointing()
    unet.train()
    shard_unet(unet, world.mesh, param_dtype=None)
    optimizer = build_optimizer("adamw8bit", unet.parameters(), 1e-5, 1e-2, (0.9, 0.999), 1e-8)
    noise_scheduler = build_noise_scheduler(str(pipeline_dir), "epsilon", zero_terminal_snr=False)
    empty_prompt = read_empty_prompt(cache_dir)
    step = TrainStep(unet, optimizer, LearningRateSchedule("constant", 1e-5, 0, 1), noise_scheduler, NoiseSettings(0.1), empty_prompt, SEED, max_grad_norm=1.0)
    metrics = MetricsWriter(output_dir / "tensorboard", enabled=world.is_main)

    loader = iter(DataLoader(dataset, batch_sampler=rank_batches, num_workers=2, collate_fn=collate))
    in_memory = [collate([dataset[index] for index in batch]) for batch in rank_batches]
    throughput = Throughput()

    def trainer_update(update: int) -> float:
        started = time.perf_counter()
        throughput.start()
        batch = next(loader)
        throughput.data_ready()
        result = step([batch], epoch=0)
        throughput.stop(PER_RANK_BATCH * world.world_size)
        memory = gather_floats(peak_memory_gib(world.device), world.device)
        metrics.scalars({"train/loss": result.loss, "train/lr": result.learning_rate, **{f"m/{r}": m for r, m in enumerate(memory)}}, update)
        return time.perf_counter() - started

    def minimal_update(update: int) -> float:
        started = time.perf_counter()
        batch = in_memory[update]
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

    for update in range(warmup):  # compiles torchao's step, warms the allocator and the loader
        trainer_update(update)
        minimal_update(update)
    times = {"trainer": [], "minimal": []}
    data_seconds_before, seconds_before = throughput.data_seconds, throughput.seconds
    update = warmup
    for _ in range(rounds):
        for path, run in (("trainer", trainer_update), ("minimal", minimal_update)):
            for offset in range(updates_per_round):
                times[path].append(run(update + offset))
        update += updates_per_round
    data_share = (throughput.data_seconds - data_seconds_before) / (throughput.seconds - seconds_before)
    if world.is_main:
        (output_dir / "times.json").write_text(json.dumps({"times": times, "data_share": data_share}))
    metrics.close()
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates_per_round", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*map(Path, args.worker), args.updates_per_round, args.rounds)
        return

    import numpy as np

    import sdxl_process_data_dir
    from sdxl_trainer.parallel import free_port
    from sdxl_trainer.tiny_model import save_tiny_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        pipeline_dir = save_tiny_pipeline(Path(tmp) / "tiny_sdxl", seed=0)
        cache_dir = Path(tmp) / "cache"
        sdxl_process_data_dir.main(
            ["--data_dir", str(REPO_ROOT / "sample_dataset"), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline_dir),
             "--min_resolution", "256", "--max_resolution", "512"]
        )
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), __file__,
                   "--updates_per_round", str(args.updates_per_round), "--rounds", str(args.rounds),
                   "--worker", str(pipeline_dir), str(cache_dir), tmp]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO_ROOT))
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        report = json.loads((Path(tmp) / "times.json").read_text())
    trainer, minimal = (np.array(report["times"][path]) for path in ("trainer", "minimal"))
    print(f"2 CPU processes, tiny SDXL UNet, batch {PER_RANK_BATCH} per rank, torchao AdamW8bit, gradient checkpointing")
    print(f"  minimal FSDP2 loop : {minimal.mean() * 1000:7.1f} ms/update (median {np.median(minimal) * 1000:.1f})")
    print(f"  trainer update     : {trainer.mean() * 1000:7.1f} ms/update (median {np.median(trainer) * 1000:.1f})")
    print(f"  overhead           : {(trainer.mean() / minimal.mean() - 1) * 100:+.1f}% (mean), {(np.median(trainer) / np.median(minimal) - 1) * 100:+.1f}% (median)")
    print(f"  data loading       : {report['data_share'] * 100:.2f}% of the trainer's update time")


if __name__ == "__main__":
    main()
