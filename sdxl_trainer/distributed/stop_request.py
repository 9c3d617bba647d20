"""Graceful stop on SIGTERM / SIGINT: finish the current update, save state, exit 0. Before training begins
(the start-up: rendezvous, checks, loading the data and the models) there is nothing to save, so a signal ends
the process at once, with one line instead of a traceback from wherever the start-up was.

A cluster pre-empting a job sends SIGTERM (SLURM: to every task), Ctrl-C sends SIGINT to the whole
foreground process group, and torchrun forwards the signal it got to its workers a moment later. So a
rank may see the same stop twice within milliseconds, and some ranks may see it while others do not:
- signals within REPEAT_GRACE_S of the first count as the same request; a later one exits at once;
- the ranks agree so they all stop after the same update: each rank's flag travels with the monitor's
  exchange at the updates that log (every --log_every_n_updates), over a gloo group on CPU tensors, so no
  update that does not log exchanges anything, and none waits for the GPU.
DataLoader worker processes ignore both signals: the training process ends them when it is done, and a
worker killed by SIGTERM would otherwise abort the main process in the middle of the save.
"""

from __future__ import annotations

import os
import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_GRACE_S = 3.0


class StoppedDuringStartUp(SystemExit):
    """A stop signal before the first update: the process ends with this line as its message (the job's
    watchdog prints it once for every rank) and exit code 1, as any refusal to start does."""


class StopRequest:
    def __init__(self, announce: bool = True) -> None:
        """Installs the handlers: from here until training_begins(), a stop signal ends the start-up at once
        (StoppedDuringStartUp); after it, the stop is graceful. `announce`: say that the signal arrived (on one
        rank: every rank gets it, the fact is one)."""
        self.announce = announce
        self.signal_name: str | None = None
        self._first_signal_at = 0.0
        self._training = False
        self._start_up_stopped = False
        self._previous_handlers = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def training_begins(self) -> None:
        """From now on a signal finishes the current update and saves (the run has state worth saving)."""
        self._training = True

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        now = time.monotonic()
        if not self._training:
            if self._start_up_stopped:  # the same stop again (torchrun forwards the one the terminal sent it): already ending
                return
            self._start_up_stopped = True
            raise StoppedDuringStartUp(
                f"{signal.Signals(signum).name} received during start-up, before the first update: stopped there "
                "(nothing was trained yet, so there was nothing to save)."
            )
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self._first_signal_at = now
            if self.announce:
                print(
                    f"{self.signal_name} received: finishing the current update, then saving state "
                    f"(send it again after {REPEAT_GRACE_S:.0f} s to exit at once, without saving).",
                    flush=True,
                )
        elif now - self._first_signal_at > REPEAT_GRACE_S:
            os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        """This rank received a stop signal (the ranks agree on stopping in the monitor's log exchange)."""
        return self.signal_name is not None

    def restore_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)


def ignore_stop_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader worker_init_fn signature
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
