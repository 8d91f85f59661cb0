"""The stop signals and the ends of the process: a time limit's warning or a preemption recorded
(``StopRequest``), the line that says how to resume (``RunStopped``), exits that cannot block
(``arm_hard_exit``, ``end_children``), and every way a run ends (``RunEnding``, below).

``StopRequest.install(names)`` replaces the handlers of the ``stop_signals`` with one that only
records the signal (nothing runs or is written from a handler; a second signal merely records it
again), but for a user's second Ctrl-C, which ends the run at once (docs/preemption.md).
"""
from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import shlex
import signal
import sys
import threading
import time

from engine.run_dir import discard_unstarted_run, release_run_locks
from engine.runtime import describe_allocation_failure, describe_dist_failure
from settings.errors import TrainingError, UserError, print_error
from settings.signals import STOPPED_EXIT_CODE, ignore_stop_signals, installed, signal_number

log = logging.getLogger("train")

INTERRUPTED_EXIT_CODE = 130  # a second Ctrl-C: 128 + SIGINT, as a shell reports it
HARD_EXIT_AFTER_S = 10.0  # seconds the cleanup of an immediate exit may take
CHILD_JOIN_S = 10.0  # seconds to wait, in all, for SIGKILLed children to end


class LoaderStalled(TrainingError):
    """A rank waited ``loader_timeout_s`` for its next batch."""


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
        self.while_waiting = None  # set by ``Stopper.fetch`` while the rank waits for data
        self.ctrl_c = False  # a SIGINT came

    @classmethod
    def install(cls, names: list[str]) -> StopRequest:
        request = cls()
        for name in names:
            number = signal_number(name)
            request._previous[number] = signal.signal(number, request._record)
            installed.add(number)
        atexit.unregister(_at_exit)  # (registered once, however many installs)
        atexit.register(_at_exit)  # runs before multiprocessing's own exit hook
        return request

    def restore(self):
        """The handlers from before ``install`` (for a caller that goes on after the run)."""
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_DFL if previous is None else previous)

    def _record(self, signum, frame):
        if signum == signal.SIGINT:
            if self.ctrl_c:  # a second Ctrl-C: the user wants out now (``RunEnding``: one line)
                raise KeyboardInterrupt
            self.ctrl_c = True
        self.signum = signum  # nothing else: the loop acts on it at a step boundary
        waiting = self.while_waiting
        if waiting is not None:  # a wait for data: it ends if the batch does not come soon
            waiting()


class NeverStop(StopRequest):
    """For trainers driven without the entry point (tests, benchmarks): never asks to stop and
    never takes part in the ranks' stop agreement."""

    agrees = False


# ---------------------------------------------------------------------- exits that cannot block


def _at_exit():
    """The process is ending: no stop signal may kill it now, nor loader workers keep it. Workers
    still running ignore the SIGTERM of multiprocessing's exit hook: they are SIGKILLed here,
    torch's SIGCHLD check (which raises on a worker killed by a signal) switched off first."""
    ignore_stop_signals()
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        end_children(children)


def arm_hard_exit(exit_code: int, seconds: float | None = None):
    """``os._exit(exit_code)`` in ``seconds`` (default ``HARD_EXIT_AFTER_S``) unless the process
    has ended by then, writing nothing (stderr may be the stalled file). A daemon timer thread,
    not SIGALRM, whose handler never runs while the main thread is blocked in a system call."""
    timer = threading.Timer(HARD_EXIT_AFTER_S if seconds is None else seconds, os._exit,
                            args=(exit_code,))
    timer.daemon = True
    timer.name = f"hard-exit({exit_code})"
    timer.start()


def end_children(children: list, timeout: float | None = None) -> list:
    """SIGKILL ``children``, wait up to ``timeout`` seconds in all (default ``CHILD_JOIN_S``), and
    return those still alive (in an uninterruptible read), which the exit hook then leaves."""
    deadline = time.monotonic() + (CHILD_JOIN_S if timeout is None else timeout)
    for p in children:
        p.kill()
    for p in children:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in children if p.is_alive()]
    # multiprocessing's exit hook joins every child in its registry (``process._children``, the
    # set ``active_children()`` reads) without a limit: those alive leave it, and are reparented
    # to init when this process ends. (``os._exit`` from an exit hook would skip the hooks after
    # it and cannot know ``sys.exit``'s code; replacing the hook would change it for every child.)
    registry = getattr(multiprocessing.process, "_children", None)
    if isinstance(registry, set):
        registry.difference_update(alive)
    return alive


# ---------------------------------------------------------------------- how a run ends

class RunEnding:
    """How a run ends, every way, in one place: the entry point trains inside ``with
    RunEnding(cfg)`` (the exit codes: docs/errors.md). Trained to the end, every rank waits for
    the others before any tears its groups down; a stop signal stops every rank at the same step
    with its checkpoint (``RunStopped``), or, too late for that, is logged; a second Ctrl-C, a
    user's error, an allocation too big, a failed collective or a stalled loader end with one
    line (the last two, and Ctrl-C, at once: ``fail(..., broken_group=True)``); anything else is
    a bug and keeps its traceback. Whatever the end, the run directory's lock is released, a
    start that failed in set-up leaves no run behind, and the trainer is freed before the process
    groups are destroyed.

    ``request``: what records the stop signals (default: handlers installed for
    ``stop_signals`` from construction on; ``NeverStop()`` for a trainer driven without the entry
    point). ``rt`` and ``trainer`` are set as the run builds them."""

    def __init__(self, cfg, request: StopRequest | None = None):
        self.cfg, self.rt, self.trainer, self.installed = cfg, None, None, request is None
        self.request = StopRequest.install(cfg.stop_signals) if request is None else request

    def fail(self, message: str, exit_code: int, broken_group: bool = False,
             every_rank: bool = False):
        """End the process with one line on stderr (and in the run's out.log, on rank 0).

        ``broken_group``: a collective failed or a loader stalled: the process group cannot be
        shut down cleanly (gloo's destructors may abort while a peer is still connected), so the
        logs are flushed and the process exits at once, within ``HARD_EXIT_AFTER_S`` even if a
        write to a stalled file system never returns (loader workers end with it)."""
        if broken_group:
            arm_hard_exit(exit_code)
        rt = self.rt
        # (an error every rank raises alike is rank 0's alone to print: print_error)
        prefix = f"[rank {rt.rank}] " if rt is not None and rt.distributed and not every_rank else ""
        record = logging.LogRecord("train", logging.ERROR, __file__, 0, message, None, None)
        for handler in logging.getLogger().handlers:  # keep the reason in the run's out.log
            if isinstance(handler, logging.FileHandler):
                handler.emit(record)
        print_error(message, prefix, every_rank)
        if broken_group:
            if self.trainer is not None:
                self.trainer.close(at_once=True)
            release_run_locks()  # (os._exit runs no exit hooks)
            if self.trainer is None:
                discard_unstarted_run()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
        raise SystemExit(exit_code)

    def __enter__(self) -> RunEnding:
        return self

    def __exit__(self, kind, e, traceback) -> bool:
        self.request.ctrl_c = False  # the run ends now: a second Ctrl-C need not end it at once
        try:
            where = "during set-up" if self.trainer is None else f"after step {self.trainer.iteration}"
            if kind is None:
                self.rt.barrier()  # every rank has finished before any tears its groups down
                # (no trainer: a finished run's resume, which ended before anything was built)
                signum = self.trainer.stopper.signalled() if self.trainer is not None else 0
                if signum:  # too late to stop before the end: the run honoured it by ending
                    log.info(f"{signal.Signals(signum).name} came as the run was ending: it "
                             f"ended as planned, on its final checkpoint "
                             f"{self.trainer.checkpointer.written_for(self.trainer.iteration)} "
                             f"(exit code 0: nothing is left to resume)")
            elif issubclass(kind, RunStopped):
                self.rt.barrier()  # all stopped at the same step: none tears down while one works
                log.info(e.message(sys.argv, self.rt.world_size))
                raise SystemExit(STOPPED_EXIT_CODE) from None
            elif issubclass(kind, KeyboardInterrupt):
                kept = f". {self.trainer.checkpointer.kept()}" if self.trainer is not None else ""
                self.fail(f"interrupted by SIGINT (Ctrl-C), at once, {where}{kept}",
                          INTERRUPTED_EXIT_CODE, broken_group=True)
            elif issubclass(kind, LoaderStalled):  # at once: its peers wait in a collective
                self.fail(str(e), e.exit_code, broken_group=True)
            elif issubclass(kind, UserError):
                self.fail(str(e), e.exit_code, every_rank=e.every_rank)
            elif issubclass(kind, (RuntimeError, MemoryError)):  # incl. torch's DistError
                too_big = describe_allocation_failure(e, self.cfg, self.rt, where)
                if too_big is not None:
                    self.fail(too_big, 2)
                message = describe_dist_failure(e, self.cfg, where)
                if message is not None:  # (None: a bug, not a peer's failure: keep the traceback)
                    self.fail(message, 1, broken_group=True)
            return False
        finally:
            self._clean_up()

    def _clean_up(self):
        if self.trainer is not None:
            self.trainer.close()
        release_run_locks()  # the run directory is free for another process (also on errors)
        if self.trainer is None:  # the start failed in set-up: it leaves no run behind
            discard_unstarted_run()
        # The trainer (its DDP reducer, its queued work) is freed while the interpreter is whole:
        # freed by gloo's threads during finalization, it aborts a run that succeeded (SIGABRT).
        self.trainer = None
        gc.collect()
        if self.rt is not None:
            self.rt.shutdown()
        if self.installed:
            self.request.restore()
