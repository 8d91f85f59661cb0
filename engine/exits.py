"""Exits that must not wait: on a stalled file system or with a loader worker stuck in a read.

``arm_hard_exit(code)`` starts a daemon timer that ends the process with ``os._exit(code)`` after
``HARD_EXIT_AFTER_S`` seconds: armed before the cleanup of an exit meant to be immediate (the
log, TensorBoard's events, the run lock: each may block on a file system that has just stalled),
so that the process ends with its exit code even when one of them never returns.

``end_children(children)`` SIGKILLs child processes, waits for them ``CHILD_JOIN_S`` seconds in
all, and takes those still alive (a process in an uninterruptible read dies only when the read
returns) off multiprocessing's list of children, so that its exit hook does not wait for them
without limit.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

HARD_EXIT_AFTER_S = 10.0  # seconds the cleanup of an immediate exit may take
CHILD_JOIN_S = 10.0  # seconds to wait, in all, for SIGKILLed children to end


def arm_hard_exit(exit_code: int, seconds: float | None = None) -> threading.Timer:
    """``os._exit(exit_code)`` in ``seconds`` (default ``HARD_EXIT_AFTER_S``) unless the process
    has ended by then. A timer thread rather than SIGALRM: a signal handler runs only between
    the main thread's bytecodes, never while it is blocked in a system call that does not return
    (a write to a hung NFS mount), while another thread still runs. Daemon: it never keeps the
    process alive. It writes nothing (stderr may be the stalled file). Returns the timer (its
    ``cancel()`` disarms it)."""
    timer = threading.Timer(HARD_EXIT_AFTER_S if seconds is None else seconds, os._exit,
                            args=(exit_code,))
    timer.daemon = True
    timer.name = f"hard-exit({exit_code})"
    timer.start()
    return timer


def end_children(children: list, timeout: float | None = None) -> list:
    """SIGKILL ``children`` (``multiprocessing.Process``), wait up to ``timeout`` seconds in all
    (default ``CHILD_JOIN_S``) for them to end, and return those still alive after it, which
    multiprocessing's exit hook will then not wait for."""
    deadline = time.monotonic() + (CHILD_JOIN_S if timeout is None else timeout)
    for p in children:
        p.kill()
    for p in children:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in children if p.is_alive()]
    for p in alive:
        _forget_child(p)
    return alive


def _forget_child(p) -> None:
    """Take ``p`` off multiprocessing's registry of this process's children. Its exit hook
    (``multiprocessing.util._exit_function``) joins every child in that registry without a
    limit, after the other exit hooks; a child that SIGKILL has not ended (uninterruptible I/O)
    would keep the process from ever exiting. Of the ways round it this is the least intrusive:
    ``os._exit`` from an exit hook would skip the hooks after it and cannot know the exit code
    of ``sys.exit``, and replacing the hook would change it for every child. The registry,
    ``multiprocessing.process._children``, is the set ``active_children()`` reads; the forgotten
    child is reparented to init when this process ends and dies when its read returns (it was
    SIGKILLed)."""
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.discard(p)
