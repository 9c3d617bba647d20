"""Started on 2 processes by test_launch.py: a job's end under the trainer's watchdog and console log, without the
trainer. Modes:
  killed  rank 1 is killed (SIGKILL) while rank 0 waits for it in a collective, which then fails;
  stop    both ranks stop alike (SystemExit, as a stop for skipped updates), rank 1 first, while rank 0's last line
          (as the trainer's "Saved state to ..." line) still sits in its stdout buffer.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sdxl_trainer.distributed.stop_request import StopRequest
from sdxl_trainer.distributed.watchdog import JobWatchdog
from sdxl_trainer.distributed.world import init_distributed
from sdxl_trainer.monitoring.console_log import ConsoleLog


def main(mode: str, folder: str) -> None:
    # As `python script.py` writes into a pipe or a file (torchrun's ranks, a log of `2>&1`): stdout kept in a buffer
    # (the warm launcher's forks write unbuffered).
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    world = init_distributed()
    with ConsoleLog(Path(folder) / "train.log", world.is_main) as console_log, JobWatchdog(world.rank, world.world_size, log_only=console_log.write_to_file_only):
        stop = StopRequest(announce=world.is_main)  # as the trainer's loop: a launcher's SIGTERM after the kill asks for a stop
        stop.training_begins()
        try:
            dist.barrier()
            if mode == "killed":
                if world.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(2.0)  # an update's compute, during which the launcher's SIGTERM (after the kill) arrives
                dist.all_reduce(torch.ones(1))  # rank 1 never joins: gloo fails, its connection closed
            elif mode == "stop":
                if world.rank == 0:
                    print("Saved state to the checkpoint the stop names.")
                    time.sleep(1.0)  # rank 1 stops first: its message is the one printed
                raise SystemExit("Stopped: resume from the checkpoint named above.")
        finally:
            stop.restore_handlers()  # as Run.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
