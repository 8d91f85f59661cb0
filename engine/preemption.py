"""Stopping a run cleanly when the cluster asks: a time limit's warning signal or a preemption.

``StopRequest.install(names)`` replaces the handlers of the named signals (default SIGTERM and
SIGUSR1, the signals Slurm sends before a time limit and on preemption) with one that only
records the signal: no Python code runs in between a step's operations, nothing is written from
a handler, and a second signal (even during the checkpoint write) merely records it again.
The ranks agree on the step to stop after (``engine.stop_agreement``), even when only one of
them got the signal, or when a signal ended a rank's wait for data (``engine.data_waits``). The
run then writes a checkpoint and ends with ``STOPPED_EXIT_CODE``, which ``submit_pm.sh`` turns
into a requeue.
"""
from __future__ import annotations

import atexit
import multiprocessing
import shlex
import signal


from engine.exits import end_children
from settings.signals import STOPPED_EXIT_CODE, ignore_stop_signals, installed, signal_number

_exit_hook_registered = False


class RunStopped(Exception):
    """Raised on every rank after the stop checkpoint; the entry point turns it into one log
    line and ``STOPPED_EXIT_CODE``."""

    def __init__(self, signum: int, iteration: int, checkpoint_path: str):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.iteration, self.checkpoint_path = signum, iteration, checkpoint_path

    def message(self, argv: list[str], ranks: int) -> str:
        return (f"Stopped on {signal.Signals(self.signum).name} after step {self.iteration}: "
                f"checkpoint {self.checkpoint_path}; resume with: {resume_command(argv, ranks)} "
                f"(exit code {STOPPED_EXIT_CODE})")


def resume_command(argv: list[str], ranks: int) -> str:
    """The command line that continues this run: its own arguments, ``--resume auto`` instead
    of any ``--resume`` they had."""
    args, i = [], 1
    while i < len(argv):
        if argv[i] == "--resume":  # a bare --resume, or --resume VALUE
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        if not argv[i].startswith("--resume="):
            args.append(argv[i])
        i += 1
    command = shlex.join([argv[0], *args, "--resume", "auto"])
    if ranks > 1:  # torchrun or srun: the launcher's own options are not in argv
        return f"the same launcher and {ranks} ranks running {command}"
    return f"python {command}"


class StopRequest:
    """The signal received (0: none), set by the handlers, read at the loop's log points."""

    def __init__(self):
        self.signum = 0
        self._previous = {}  # signal number -> the handler before install
        self.while_waiting = None  # set by ``DataWaits.fetch`` while the rank waits for data

    @classmethod
    def install(cls, names: list[str]) -> StopRequest:
        request = cls()
        for name in names:
            number = signal_number(name)
            request._previous[number] = signal.signal(number, request._record)
            installed.add(number)
        global _exit_hook_registered
        if not _exit_hook_registered:
            atexit.register(_at_exit)  # runs before multiprocessing's own exit hook
            _exit_hook_registered = True
        return request

    def restore(self):
        """The handlers from before ``install`` (for a caller that goes on after the run)."""
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_DFL if previous is None else previous)

    def _record(self, signum, frame):
        self.signum = signum  # nothing else: the loop acts on it at a step boundary
        waiting = self.while_waiting
        if waiting is not None:  # a wait for data: it ends if the batch does not come soon
            waiting()


class NeverStop(StopRequest):
    """For trainers driven without the entry point (tests, benchmarks): never asks to stop and
    never takes part in the ranks' stop agreement (``engine.stop_agreement``)."""

    agrees = False


def _at_exit():
    """The process is ending: no stop signal may kill it now, nor loader workers keep it."""
    ignore_stop_signals()
    _end_loader_workers()


def _end_loader_workers():
    """At exit, loader workers still running (a run that ended on an exception keeps its loaders
    referenced) ignore SIGTERM, with which multiprocessing's exit hook would end them before
    waiting for them: end them here with SIGKILL instead. Their ends are expected, so torch's
    SIGCHLD check (which raises on a worker killed by a signal) is switched off first. A worker
    in an uninterruptible read dies only when the read returns: after a bounded wait
    (``engine.exits.CHILD_JOIN_S``) those still alive are left to end on their own, off the list
    that multiprocessing's exit hook would join without a limit (``engine.exits.end_children``)."""
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        end_children(children)
