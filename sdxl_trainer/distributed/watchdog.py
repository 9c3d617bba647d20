"""Every fault ends the whole job, at once, with its message printed once.

Without this, an error in one rank hangs the job: the other ranks wait forever in their next collective,
and the failing rank itself may never exit (its DataLoader workers ignore SIGTERM/SIGINT, see
stop_request.py), so torchrun waits too. And killing only the launcher leaves the ranks training on as
orphans that write into the run folder.

JobWatchdog wraps a rank's whole run:
- an exception (or a SystemExit with a message) on any rank is reported to the job's rendezvous store
  (the TCPStore torchrun and accelerate already run at MASTER_ADDR:MASTER_PORT); the first failing rank
  prints its message, and the process ends with exit code 1 without waiting for anything;
- a thread in every rank polls the store every POLL_S seconds: when another rank has failed, it ends its
  own process, even while the main thread is blocked in a collective;
- the same thread ends the rank when its launcher is gone (its parent process changed) or the store
  cannot be reached (the launcher on the first machine is gone).
The failing rank's message is the last thing on its machine's console: it is printed once the other ranks
have stopped (or after ENDED_WAIT_S), on a line of its own, so neither their progress bar nor their output
follows it; they exit only once it is printed, as a launcher stops every process when the first one exits.
A SystemExit (a refusal or stop every rank reaches alike) is printed alone, any other error under one line
saying the job stops; the other ranks end silently on that machine, and say in one line which rank failed
on the other machines.
DataLoader workers of an ending rank are killed first, as they ignore the signals a launcher sends.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

POLL_S = 1.0
ENDED_WAIT_S = 2 * POLL_S + 1.0  # the others notice a failure within POLL_S
FIRST_FAILED_RANK = "first_failed_rank"
ENDED_RANKS = "ended_ranks"
FAILURE_REPORTED = "failure_reported"
STORE_TIMEOUT = timedelta(seconds=60)
EXIT_CODE = 1


def _end_process(message: str, store: dist.Store | None = None) -> None:
    """Print (if there is something to say), tell the other ranks through `store` that it is said, kill this
    rank's worker processes, and exit now (no cleanup that could wait on other ranks). What the run printed
    before goes out first: stdout into a pipe or file is held in a buffer, and the message (on stderr, not
    buffered) came out above the lines it refers to (the save a stop names) in a log of both."""
    _flush(sys.stdout)
    if message:
        print(message, file=sys.stderr, flush=True)
    if store is not None:
        try:
            store.set(FAILURE_REPORTED, "1")
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher; the message is out
            pass
    for child in multiprocessing.active_children():
        child.kill()
    _flush(sys.stdout)
    os._exit(EXIT_CODE)


def lost_another_rank(error: BaseException) -> bool:
    """Whether `error` is a collective (or the rendezvous store) failing because another process of the job is
    gone: torch's distributed errors, or gloo's closed connection as a plain RuntimeError."""
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(words in text for words in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))
    )


def _flush(stream) -> None:
    try:
        stream.flush()
    except (OSError, ValueError):  # a closed pipe or file: the process ends all the same
        pass


class JobWatchdog:
    def __init__(self, rank: int, world_size: int, expected_errors: tuple[type[BaseException], ...] = (),
                 log_only: Callable[[str], Path | None] | None = None):
        """`expected_errors`: exception classes whose message says everything (a full disk, a damaged cache);
        any other exception is printed with its traceback. `log_only(text)`: writes text into the run's log file
        only, not the console, and returns the file (None where there is none): ConsoleLog.write_to_file_only."""
        self.rank = rank
        self.world_size = world_size
        self.expected_errors = expected_errors
        self.log_only = log_only
        # Under a launcher (torchrun sets TORCHELASTIC_RUN_ID), a launcher that died would leave this rank
        # training on as an orphan. A process started without one (train.sh with one process) is a program
        # like any other: it goes on when the shell that started it ends (nohup, a closed terminal).
        self._parent_pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._finished = threading.Event()
        self._store: dist.Store | None = None
        if world_size > 1:
            run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT)
            self._store = dist.PrefixStore(f"sdxl_watchdog/{run_id}/", store)
            self._store.set(f"host_of_rank_{rank}", socket.gethostname())

    def __enter__(self) -> JobWatchdog:
        self._thread = threading.Thread(target=self._watch, name="job-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, error_type, error, error_traceback) -> bool:
        self._finished.set()
        if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
            # The thread may be inside a store call. Left running into the interpreter's shutdown, it is ended
            # there by a forced unwind through the store's C++ frames, which aborts the process ("terminate called
            # without an active exception", SIGABRT) after a run that finished well.
            self._thread.join(timeout=STORE_TIMEOUT.total_seconds() + POLL_S)
            return False
        # What this rank printed goes out before any rank's message (stdout into a pipe or file is buffered; the first
        # failing rank prints once the others have ended, which is after this).
        _flush(sys.stdout)
        message = self.describe(error)
        failed_rank = self.rank
        if self._store is not None:
            try:
                # Set only if no rank failed before (atomic): the value that holds is the first failed rank.
                failed_rank = int(self._store.compare_set(FIRST_FAILED_RANK, "", str(self.rank)))
            except Exception:  # noqa: BLE001 - the store may be gone with the launcher; the message still matters
                pass
        if failed_rank == self.rank:
            self._wait_for_the_others_to_end()
            # A new line first: a progress bar may hold the current one.
            if isinstance(error, SystemExit) or self.world_size == 1:
                _end_process(f"\n{message}", self._store)
            if lost_another_rank(error):
                _end_process(f"\n{self._lost_rank_message(error, message)}", self._store)
            _end_process(f"\n[rank {self.rank}] The whole job is stopping (exit code {EXIT_CODE}) after this error:\n{message}", self._store)
        # Every rank reaches the same refusal or stop (SystemExit) alike; the first one prints it.
        self._end_after_another_rank(failed_rank, quietly=isinstance(error, SystemExit))
        return False  # not reached

    def _lost_rank_message(self, error: BaseException, details: str) -> str:
        """A collective failed because another rank is gone (killed with SIGKILL, as the kernel's out-of-memory
        killer does, or crashed): that rank printed nothing, and the launcher names it in the line that matters.
        So this rank says so in one line, and its traceback (some 70 lines, all about the collective) goes into
        the run's log, or after that line where this rank keeps none."""
        # gloo's first line: "[.../pair.cc:561] Connection closed by peer [127.0.0.1]:16259. This is typically caused by ..."
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        reason = re.sub(r"^\[[^\]]*\]\s*", "", first_line).split(". ")[0][:160]
        line = (
            f"[rank {self.rank}] The whole job is stopping (exit code {EXIT_CODE}): a collective with the other ranks failed ({reason}), "
            "so another rank has probably ended without a message of its own (the launcher names it; SIGKILL is often the "
            "out-of-memory killer)"
        )
        logged = self.log_only(f"[rank {self.rank}] The traceback of the failed collective (the line after it says why):\n{details}") if self.log_only else None
        return f"{line}; its traceback is in {logged}." if logged is not None else f"{line}. This rank's traceback:\n{details}"

    def describe(self, error: BaseException) -> str:
        if isinstance(error, SystemExit):
            return str(error.code)
        if isinstance(error, self.expected_errors):
            return str(error)
        return "".join(traceback.format_exception(error)).rstrip()

    def _wait_for_the_others_to_end(self) -> None:
        deadline = time.monotonic() + ENDED_WAIT_S
        try:
            while self._store is not None and self._store.add(ENDED_RANKS, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher; the message still matters
            pass

    def _end_after_another_rank(self, failed_rank: int, quietly: bool = False) -> None:
        """End this rank because `failed_rank` failed first: silently where its message is on this console
        already (same machine) or `quietly`, else with one line naming it."""
        try:
            host = self._store.get(f"host_of_rank_{failed_rank}").decode() if self._store is not None else ""
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher
            host = ""
        if not (quietly or host == socket.gethostname()):
            print(f"[rank {self.rank}] Stopping because rank {failed_rank}{f' on {host}' if host else ''} failed (its message is on that machine's console).", file=sys.stderr, flush=True)
        self._wait_for_the_failure_report()
        _end_process("")

    def _wait_for_the_failure_report(self) -> None:
        """Say this rank has ended, then stay until the failed rank has printed its message: a launcher stops
        the whole job when the first of its processes exits (torchrun within 0.1 s), and the failed rank,
        waiting for this one to end, must not be stopped before its message is out."""
        deadline = time.monotonic() + ENDED_WAIT_S + POLL_S
        try:
            if self._store is not None:
                self._store.add(ENDED_RANKS, 1)
            while self._store is not None and not self._store.check([FAILURE_REPORTED]) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher
            pass

    def _watch(self) -> None:
        while not self._finished.wait(POLL_S):
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                _end_process(f"[rank {self.rank}] The launcher (process {self._parent_pid}) is gone: stopping, so no orphaned rank trains on.")
            if self._store is None:
                continue
            try:
                failed_rank = int(self._store.get(FIRST_FAILED_RANK)) if self._store.check([FIRST_FAILED_RANK]) else None
            except Exception as error:  # noqa: BLE001 - any store failure means the job is gone
                if self._finished.is_set():
                    return
                _end_process(f"[rank {self.rank}] Lost the job's rendezvous store ({error}): the launcher has ended. Stopping.")
            if failed_rank is not None and not self._finished.is_set():
                self._end_after_another_rank(failed_rank)
