"""torchrun, as train.sh starts it, without the launcher output that would bury a failing rank's message.

A rank that fails prints why (watchdog.py; argparse for a bad flag) and ends the job. torchrun would then
log that it stops the other ranks and which rank failed, and raise ChildFailedError, whose traceback and
table would be the last thing on screen. Here those two log lines are dropped (library_noise.py) and the
error becomes the failing rank's exit code, so its message stays last; only a rank that died without a word
(killed by a signal) is named, in one line. Everything else is torchrun's own behaviour and flags:

    python -m sdxl_trainer.distributed.launcher --nproc_per_node 2 ... sdxl_FSDP_train.py TRAINER_FLAGS...
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main(argv: list[str] | None = None) -> int:
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
    except SignalException as stopped:
        # SIGTERM / SIGINT to the launcher: torchrun passed it on, and the ranks said whether they saved state.
        return 128 + stopped.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
