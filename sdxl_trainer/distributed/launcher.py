"""torchrun, as train.sh starts it, without the launcher output that would bury a failing rank's message.

A rank that fails prints why (watchdog.py; argparse for a bad flag) and ends the job. torchrun would then
log that it stops the other ranks and which rank failed, and raise ChildFailedError, whose traceback and
table would be the last thing on screen. Here those two log lines are dropped (library_noise.py) and the
error becomes the failing rank's exit code, so its message stays last; only a rank that died without a word
(killed by a signal) is named, in one line, as is a rendezvous port already in use (torchrun's own
EADDRINUSE traceback is 40 lines). `--master_port free` takes a port that is free at the start (train.sh
gives it on one machine, so two runs or a test beside a job do not collide on 29500). Everything else is
torchrun's own behaviour and flags:

    python -m sdxl_trainer.distributed.launcher --nproc_per_node 2 ... sdxl_FSDP_train.py TRAINER_FLAGS...
"""

from __future__ import annotations

import sys

from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun
from torch.distributed.run import parse_args

from sdxl_trainer.distributed.world import free_port

FREE_PORT = "free"  # --master_port value: any port free now


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for position, argument in enumerate(argv[:-1]):
        if argument == "--master_port" and argv[position + 1] == FREE_PORT:
            argv[position + 1] = str(free_port())
            break
    try:
        torchrun(argv)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode  # the rank printed its own message
        print(
            f"Rank {rank} (process {failure.pid}) was ended by {failure.signal_name()} without a message of its own "
            "(SIGKILL often means the machine ran out of memory; SIGSEGV or SIGBUS, a crash).",
            file=sys.stderr,
        )
        return 1
    except DistNetworkError as error:
        if "EADDRINUSE" not in str(error):
            raise
        port = parse_args(argv).master_port
        print(
            f"Port {port} of the rendezvous (MAIN_PROCESS_PORT) is in use on this machine, by another run or program: give another "
            "(the same on every machine), or leave MAIN_PROCESS_PORT unset on a single machine and train.sh picks a free one.",
            file=sys.stderr,
        )
        return 1
    except SignalException as stopped:
        # SIGTERM / SIGINT to the launcher: torchrun passed it on, and the ranks said whether they saved state.
        return 128 + stopped.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
