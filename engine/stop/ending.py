"""How a run ends, every way, in one place: the entry point trains inside ``with RunEnding(cfg)``
(the exit codes: docs/errors.md).

- trained to the end: every rank waits for the others before any tears its groups down;
- a stop signal: every rank stopped at the same step with its checkpoint (``RunStopped``), one
  line saying how to resume;
- a user's error (``UserError``), or an allocation too big for the device: one line;
- a failed collective (a dead or hung peer rank) or a stalled loader: one line, and the process
  ends at once (``fail(..., broken_group=True)``);
- anything else is a bug and keeps its traceback.
Whatever the end, the run directory's lock is released, a start that failed in set-up leaves no
run behind, and the trainer is freed before the process groups are destroyed.
"""
from __future__ import annotations

import gc
import logging
import os
import sys

from engine.run_dir import discard_unstarted_run, release_run_locks
from engine.runtime import describe_allocation_failure, describe_dist_failure
from engine.stop.signals import RunStopped, StopRequest, arm_hard_exit
from engine.stop.waits import LoaderStalled
from settings.errors import UserError, print_error
from settings.signals import STOPPED_EXIT_CODE

log = logging.getLogger("train")


class RunEnding:
    """The stop signals' handlers (installed from construction on: a signal stops cleanly) and
    the run's end. ``request``: what records the stop signals (default: handlers installed for
    ``stop_signals``; ``NeverStop()`` for a trainer driven without the entry point). ``rt`` and
    ``trainer`` are set as the run builds them; ``trainer.close()`` ends its loaders and waits,
    ``trainer.close(at_once=True)`` only flushes what it shows."""

    def __init__(self, cfg, request: StopRequest | None = None):
        self.cfg, self.rt, self.trainer, self.installed = cfg, None, None, request is None
        self.request = StopRequest.install(cfg.stop_signals) if request is None else request

    def fail(self, message: str, exit_code: int, broken_group: bool = False):
        """End the process with one line on stderr (and in the run's out.log, on rank 0).

        ``broken_group``: a collective failed (a peer died or hangs), or a loader stalled (its
        peers wait in a collective; its workers in reads that even SIGKILL may not end soon).
        The process group cannot be shut down cleanly then (gloo's destructors may abort the
        process while a peer is still connected): the logs and TensorBoard events are flushed
        and the process exits at once (loader workers end with it: exit_with_parent), within
        ``HARD_EXIT_AFTER_S`` even if a write to a stalled file system never returns."""
        if broken_group:
            arm_hard_exit(exit_code)
        rt = self.rt
        prefix = f"[rank {rt.rank}] " if rt is not None and rt.distributed else ""
        record = logging.LogRecord("train", logging.ERROR, __file__, 0, message, None, None)
        for handler in logging.getLogger().handlers:  # keep the reason in the run's out.log
            if isinstance(handler, logging.FileHandler):
                handler.emit(record)
        print_error(message, prefix)
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
        try:
            if kind is None:
                self.rt.barrier()  # every rank has finished before any tears its groups down
            elif issubclass(kind, RunStopped):
                self.rt.barrier()  # all stopped at the same step: none tears down while one works
                log.info(e.message(sys.argv, self.rt.world_size))
                raise SystemExit(STOPPED_EXIT_CODE) from None
            elif issubclass(kind, LoaderStalled):  # at once: its peers wait in a collective
                self.fail(str(e), e.exit_code, broken_group=True)
            elif issubclass(kind, UserError):
                self.fail(str(e), e.exit_code)
            elif issubclass(kind, (RuntimeError, MemoryError)):  # incl. torch's DistError
                where = (f"after step {self.trainer.iteration}" if self.trainer is not None
                         else "during set-up")
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
        # The trainer (its DDP reducer, the work it queued) is freed before the process groups
        # are destroyed, while the interpreter is whole (its data waits' watchdog thread, which
        # held it, has ended): left to the interpreter's exit, gloo's threads could free it
        # during finalization, which aborts the process (SIGABRT, "terminate called without an
        # active exception") after a run that succeeded.
        self.trainer = None
        gc.collect()
        if self.rt is not None:
            self.rt.shutdown()
        if self.installed:
            self.request.restore()
