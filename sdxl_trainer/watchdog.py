"""Every fault ends the whole job, at once, with its message printed once.

Without this, an error in one rank hangs the job: the other ranks wait forever in their next collective,
and the failing rank itself may never exit (its DataLoader workers ignore SIGTERM/SIGINT, see
stop_request.py), so torchrun waits too. And killing only the launcher leaves the ranks training on as
orphans that write into the run folder.

JobWatchdog wraps a rank's whole run:
- an exception (or a SystemExit with a message) on any rank is reported to the job's rendezvous store
  (the TCPStore torchrun and accelerate already run at MASTER_ADDR:MASTER_PORT); the first failing rank
  prints its message, and the process ends with exit code 1 without waiting for anything;
- a thread in every rank polls the store every POLL_S seconds: when another rank has failed, it prints one
  line naming that rank and ends its own process, even while the main thread is blocked in a collective;
- the same thread ends the rank when its launcher is gone (its parent process changed) or the store
  cannot be reached (the launcher on the first machine is gone).
DataLoader workers of an ending rank are killed first, as they ignore the signals a launcher sends.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from datetime import timedelta

import torch.distributed as dist

POLL_S = 1.0
STORE_TIMEOUT = timedelta(seconds=60)
EXIT_CODE = 1


def _end_process(message: str) -> None:
    """Print, kill this rank's worker processes, and exit now (no cleanup that could wait on other ranks)."""
    print(message, file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    os._exit(EXIT_CODE)


class JobWatchdog:
    def __init__(self, rank: int, world_size: int, expected_errors: tuple[type[BaseException], ...] = ()):
        """`expected_errors`: exception classes whose message says everything (a full disk, a damaged cache);
        any other exception is printed with its traceback."""
        self.rank = rank
        self.world_size = world_size
        self.expected_errors = expected_errors
        self._parent_pid = os.getppid()
        self._finished = threading.Event()
        self._store: dist.Store | None = None
        if world_size > 1:
            run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT)
            self._store = dist.PrefixStore(f"sdxl_watchdog/{run_id}/", store)

    def __enter__(self) -> JobWatchdog:
        threading.Thread(target=self._watch, name="job-watchdog", daemon=True).start()
        return self

    def __exit__(self, error_type, error, error_traceback) -> bool:
        self._finished.set()
        if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
            return False
        message = self.describe(error)
        first = True
        if self._store is not None:
            try:
                first = self._store.add("failures", 1) == 1
                if first:
                    self._store.add("first_failed_rank_plus_1", self.rank + 1)  # add, not set: reading it never blocks
            except Exception:  # noqa: BLE001 - the store may be gone with the launcher; the message still matters
                pass
        if first:
            _end_process(f"[rank {self.rank}] {message}\nThe whole job is stopping (exit code {EXIT_CODE}).")
        _end_process(f"[rank {self.rank}] Stopping: another rank failed first (see its message).")
        return False  # not reached

    def describe(self, error: BaseException) -> str:
        if isinstance(error, SystemExit):
            return str(error.code)
        if isinstance(error, self.expected_errors):
            return str(error)
        return "".join(traceback.format_exception(error)).rstrip()

    def _watch(self) -> None:
        while not self._finished.wait(POLL_S):
            if os.getppid() != self._parent_pid:
                _end_process(f"[rank {self.rank}] The launcher (process {self._parent_pid}) is gone: stopping, so no orphaned rank trains on.")
            if self._store is None:
                continue
            try:
                failed = self._store.add("failures", 0) > 0
                failed_rank = self._store.add("first_failed_rank_plus_1", 0) - 1 if failed else -1
            except Exception as error:  # noqa: BLE001 - any store failure means the job is gone
                if self._finished.is_set():
                    return
                _end_process(f"[rank {self.rank}] Lost the job's rendezvous store ({error}): the launcher has ended. Stopping.")
            if failed and not self._finished.is_set():
                which = f"rank {failed_rank}" if failed_rank >= 0 else "another rank"
                _end_process(f"[rank {self.rank}] Stopping because {which} failed (see its message).")
