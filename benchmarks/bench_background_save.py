"""Does a background state save slow the updates it overlaps? The trainer's step on the tiny UNet (or full size
on a GPU), its Checkpointer writing the state (UNet, 8-bit optimizer state, EMA) in a thread after an update,
against the same updates with nothing written, alternating in rounds so that the machine's noise hits both.

    venv/bin/python benchmarks/bench_background_save.py [--model tiny] [--rounds 4] [--updates_per_round 4]
    venv/bin/torchrun --nproc_per_node 2 benchmarks/bench_background_save.py

In a saving round every update is preceded by a save started in the background (the previous one waited for
first, as --save_state_every_n_updates 1 does); only the update itself is timed, not the wait or the copy the
save makes before it returns (the loop's pause, which the trainer reports on its own), and an update counts
only if the write was still going when it ended. Printed: ms per update with and without a write in flight,
their ratio, and the share of saving-round updates a write overlapped. The trainer keeps the thread while the
ratio stays within 1.10 (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import shutil
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the trainer's package and benchmarks.lib

import torch  # noqa: E402

from benchmarks.lib.results import device_name, write_json  # noqa: E402
from benchmarks.lib.steps import StepSettings, build_trainer  # noqa: E402
from benchmarks.lib.timing import synchronize  # noqa: E402
from benchmarks.lib.unets import MODEL_HELP, UNET_BUILDERS  # noqa: E402
from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed  # noqa: E402
from sdxl_trainer.state.checkpointer import Checkpointer, CheckpointOptions, RunFacts  # noqa: E402
from sdxl_trainer.training.ema import ShardedEMA  # noqa: E402
from sdxl_trainer.training.stream import DataPosition  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(UNET_BUILDERS), default="tiny", help=MODEL_HELP)
    parser.add_argument("--resolution", type=int, default=256, help="square image side in px")
    parser.add_argument("--batch_size", type=int, default=2, help="images per update and process")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each kind, alternating")
    parser.add_argument("--updates_per_round", type=int, default=4)
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/bench_background_save"), help="where the checkpoints go (emptied first)")
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    world = init_distributed()
    settings = StepSettings(model=args.model, resolution=args.resolution, batch_size=args.batch_size, gradient_checkpointing=True)
    path = build_trainer(settings, world)
    ema = ShardedEMA(path.model, 0.999, on_cpu=False)
    facts = RunFacts(settings.optimizer, settings.weights_dtype, True, False, "", args.batch_size * world.world_size, 1)
    options = CheckpointOptions(save_state=True, save_state_every_n_updates=0, checkpoints_total_limit=1)
    position = DataPosition.epoch_start(0)
    updates = 0

    def update() -> float:
        nonlocal updates
        synchronize(world.device)
        started = time.perf_counter()
        path.step(updates)
        ema.update()
        synchronize(world.device)
        updates += 1
        return time.perf_counter() - started

    folder = args.work_dir / "checkpoints"
    if world.is_main:
        shutil.rmtree(folder, ignore_errors=True)
    torch.distributed.barrier()
    checkpointer = Checkpointer(folder, options, path.model, path.train_step.optimizer, ema, path.train_step, facts, seed=0,
                                report=lambda message: None, last_saved_update=None)  # fmt: skip
    for _ in range(2):  # warm-up: the first update compiles, the first save builds its plan
        update()
    checkpointer.save_in_background(position)
    checkpointer.wait()
    quiet, overlapped, saving_updates = [], [], 0
    for _ in range(args.rounds):
        quiet += [update() for _ in range(args.updates_per_round)]
        for _ in range(args.updates_per_round):
            checkpointer.save_in_background(position)
            seconds = update()
            saving_updates += 1
            if checkpointer.writing_in_background():
                overlapped.append(seconds)
        checkpointer.wait()
    if world.is_main:
        quiet_ms, overlapped_ms = 1000 * statistics.median(quiet), 1000 * statistics.median(overlapped) if overlapped else float("nan")
        print(f"{args.model} UNet, {args.resolution} px, batch {args.batch_size}, {world.world_size} x {device_name(world.device)}, "
              f"{args.rounds} rounds of {args.updates_per_round} updates each way:")  # fmt: skip
        print(f"  without a save: {quiet_ms:.0f} ms per update (median of {len(quiet)})")
        print(f"  with a write in flight: {overlapped_ms:.0f} ms per update (median of {len(overlapped)}; "
              f"{len(overlapped)} of {saving_updates} updates overlapped a write)")  # fmt: skip
        print(f"  ratio: {overlapped_ms / quiet_ms:.3f}")
        if args.output:
            write_json(args.output, {"settings": vars(args) | {"output": str(args.output)}, "quiet_seconds": quiet, "overlapped_seconds": overlapped,
                                     "saving_updates": saving_updates, "quiet_median_ms": quiet_ms, "overlapped_median_ms": overlapped_ms,
                                     "ratio": overlapped_ms / quiet_ms}, world.device)  # fmt: skip
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
