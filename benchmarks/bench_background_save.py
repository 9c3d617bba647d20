"""Does a background state save slow the updates it overlaps? The trainer's update on the tiny UNet (or full
size on a GPU), timed with nothing being written, while the trainer's writer process writes a save
(Checkpointer.save_in_background), and while a thread of the training process writes the same save (the writer
before 2026-11-29), in alternating rounds so that the machine's noise hits all three.

    venv/bin/python benchmarks/bench_background_save.py [--rounds 3] [--output FILE]

What is written is one GPU's share of an 8-GPU SDXL run, as far as it matters to a writer: the state of SDXL's
UNet architecture at a quarter of its width (all 1,680 tensors, 225 M parameters, FSDP2-sharded, so DTensors),
its 8-bit AdamW state and an EMA: 2.3 GB a save, written, checksummed and renamed by the trainer's own
write_staged_state either way.

By default the update computes on one thread (--threads 1), leaving this machine's second core to the writer:
as on a GPU machine, whose update waits on one Python thread launching kernels while other cores sit idle, what
is left to slow the update is the writer's hold on Python's interpreter lock (thread) or on the memory bus
(both). Only the update itself is timed (not the copy a save makes before it returns, the loop's pause, which
the trainer reports on its own), and an update counts as overlapped only if the write was still going when it
ended. Printed: ms per update in each case, the ratios to the quiet updates, and how long a write took.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import UNet2DConditionModel  # noqa: E402

from benchmarks.lib.results import device_name, write_json  # noqa: E402
from benchmarks.lib.steps import StepSettings, build_trainer, make_optimizer  # noqa: E402
from benchmarks.lib.timing import synchronize  # noqa: E402
from benchmarks.lib.unets import MODEL_HELP, UNET_BUILDERS, UNET_CONFIGS  # noqa: E402
from sdxl_trainer.distributed.fsdp import shard_unet  # noqa: E402
from sdxl_trainer.distributed.world import World, init_distributed, shutdown_distributed  # noqa: E402
from sdxl_trainer.models.sdxl import SDXL_UNET_CONFIG  # noqa: E402
from sdxl_trainer.state.checkpointer import Checkpointer, CheckpointOptions, RunFacts  # noqa: E402
from sdxl_trainer.state.save import StagedState, TensorStager, stage_training_state, write_staged_state  # noqa: E402
from sdxl_trainer.state.trainer_state import TrainerState  # noqa: E402
from sdxl_trainer.training.ema import ShardedEMA  # noqa: E402
from sdxl_trainer.training.stream import DataPosition  # noqa: E402

# SDXL's UNet at a quarter of its width: every one of its 1,680 tensors, 225 M parameters (a GPU's share of
# SDXL's 2.57 B over 8 is 321 M). 16 groups per norm, as 32 do not divide 80 channels.
SAVED_UNET_CONFIG = {**SDXL_UNET_CONFIG, "block_out_channels": (80, 160, 320), "norm_num_groups": 16}


SAVED_UNETS = {"sdxl_quarter": SAVED_UNET_CONFIG, "tiny": UNET_CONFIGS["tiny"]}


def saved_state(world: World, unet_config: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedEMA]:
    """The UNet, its 8-bit AdamW state (after one update) and an EMA."""
    unet = shard_unet(UNet2DConditionModel(**unet_config), world.mesh, param_dtype=None)
    optimizer = make_optimizer("adamw8bit", unet.parameters())
    for param in unet.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # makes the 8-bit state
    optimizer.zero_grad(set_to_none=True)
    return unet, optimizer, ShardedEMA(unet, 0.999, on_cpu=False)


def write_in_a_thread(folder: Path, staged: StagedState, group: dist.ProcessGroup) -> threading.Thread:
    """The writer before 2026-11-29: write_staged_state in a thread of the training process."""
    thread = threading.Thread(target=write_staged_state, args=(folder, staged, group), daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(UNET_BUILDERS), default="tiny", help="the UNet trained in the timed updates: " + MODEL_HELP)
    parser.add_argument("--resolution", type=int, default=128, help="square image side in px")
    parser.add_argument("--batch_size", type=int, default=1, help="images per update")
    parser.add_argument("--saved_unet", choices=tuple(SAVED_UNETS), default="sdxl_quarter",
                        help="whose state each save writes: sdxl_quarter = SDXL's UNet at a quarter width (2.3 GB with its 8-bit AdamW state and "
                        "EMA); tiny = the tests' tiny UNet (a quick check that the benchmark runs)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads for the update (on a GPU machine: ignored)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three kinds, alternating")
    parser.add_argument("--quiet_updates", type=int, default=8, help="updates timed without a write, per round")
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/bench_background_save"), help="where the checkpoints go (its process/ and thread/ folders emptied first)")
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    world = init_distributed()
    if world.world_size != 1:
        raise SystemExit("bench_background_save.py runs as one process")
    settings = StepSettings(model=args.model, resolution=args.resolution, batch_size=args.batch_size, gradient_checkpointing=True)
    path = build_trainer(settings, world)
    updates = 0

    def update() -> float:
        nonlocal updates
        synchronize(world.device)
        started = time.perf_counter()
        path.step(updates)
        synchronize(world.device)
        updates += 1
        return time.perf_counter() - started

    shutil.rmtree(args.work_dir / "process", ignore_errors=True)
    unet, optimizer, ema = saved_state(world, SAVED_UNETS[args.saved_unet])
    facts = RunFacts("adamw8bit", "fp32", True, False, "", world.world_size, 1)
    options = CheckpointOptions(save_state=True, save_state_every_n_updates=0, checkpoints_total_limit=1)
    checkpointer = Checkpointer(args.work_dir / "process", options, unet, optimizer, ema, path.train_step, facts, seed=0,
                                report=lambda message: None, last_saved_update=None)  # fmt: skip
    thread_group, thread_stager = dist.new_group(backend="gloo"), TensorStager()

    def save_in_a_thread() -> threading.Thread:
        state = TrainerState(update=updates, epoch=0, updates_in_epoch=updates, seed=0, optimizer="adamw8bit", use_ema=True, ema_updates=0,
                             world_size=1, global_batch_size=args.batch_size, gradient_accumulation_steps=1, skipped_updates=0,
                             consecutive_skipped_updates=0, loss_scaler=None)  # fmt: skip
        staged = stage_training_state(unet, optimizer, ema, state, DataPosition.epoch_start(0), thread_stager)
        shutil.rmtree(args.work_dir / "thread", ignore_errors=True)
        return write_in_a_thread(args.work_dir / "thread" / f"update_{updates}", staged, thread_group)

    for _ in range(2):  # warm-up: the first update compiles, the first save builds its plan and starts the writer
        update()
    checkpointer.save_in_background(DataPosition.epoch_start(0))
    checkpointer.wait()
    save_in_a_thread().join()
    timed: dict[str, list[float]] = {"quiet": [], "thread": [], "process": []}
    writes: dict[str, list[float]] = {"thread": [], "process": []}  # seconds from a write's start to the update that saw it done
    for _ in range(args.rounds):
        timed["quiet"] += [update() for _ in range(args.quiet_updates)]
        for kind in ("process", "thread"):
            if kind == "process":
                checkpointer.save_in_background(DataPosition.epoch_start(0))
                writing = checkpointer.writing_in_background
            else:
                thread = save_in_a_thread()
                writing = thread.is_alive
            started = time.perf_counter()
            while True:
                seconds = update()
                if not writing():
                    break
                timed[kind].append(seconds)
            writes[kind].append(time.perf_counter() - started)
            checkpointer.wait() if kind == "process" else thread.join()
    checkpointer.close()
    medians = {kind: 1000 * statistics.median(seconds) if seconds else float("nan") for kind, seconds in timed.items()}
    ratios = {kind: medians[kind] / medians["quiet"] for kind in ("thread", "process")}
    print(f"{args.model} UNet, {args.resolution} px, batch {args.batch_size}, {device_name(world.device)}, {args.threads} thread(s) for the update, "
          f"{args.rounds} rounds; each save writes the state of the {args.saved_unet} UNet, its 8-bit AdamW state and EMA:")  # fmt: skip
    print(f"  without a write: {medians['quiet']:.0f} ms per update (median of {len(timed['quiet'])})")
    for kind, where in (("process", "the trainer's writer process"), ("thread", "a thread of the training process")):
        print(f"  while {where} writes: {medians[kind]:.0f} ms per update (median of {len(timed[kind])}, "
              f"{statistics.median(writes[kind]):.1f} s a write), ratio {ratios[kind]:.3f}")  # fmt: skip
    if args.output:
        write_json(args.output, {"settings": vars(args) | {"output": str(args.output), "work_dir": str(args.work_dir)},
                                 "update_seconds": timed, "write_seconds": writes, "median_ms": medians, "ratio": ratios}, world.device)  # fmt: skip
    shutdown_distributed()
    shutil.rmtree(args.work_dir / "thread", ignore_errors=True)  # the process's newest checkpoint stays, as the trainer's would
    return 0


if __name__ == "__main__":
    sys.exit(main())
