"""The stop signals as the settings name them: the ``stop_signals`` setting's names checked
before torch loads, the exit code of a run they stopped, and how a process that is not the
run's (a loader worker) ignores them. What acts on them is ``engine.stop``."""
from __future__ import annotations

import contextlib
import signal

from settings.errors import ConfigError

STOPPED_EXIT_CODE = 3  # "stopped on a signal, resumable": distinct from 0, 1 (failure), 2 (usage)
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
installed: set[int] = set()  # signals whose handler this process replaced (workers inherit it)


def signal_number(name: str) -> int:
    """``SIGTERM``, ``TERM`` or ``sigterm`` as a signal number; ConfigError when not a signal
    that a process can catch."""
    full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    number = signal.Signals.__members__.get(full)
    if number is None or full in _UNCATCHABLE:
        raise ConfigError(f"stop_signals: {name!r} is not a signal a run can catch: use names "
                          f"such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT (not SIGKILL or SIGSTOP)")
    return int(number)


def ignore_stop_signals(numbers=None):
    """From now on the stop signals (``numbers``; by default those whose handler this process
    replaced) do nothing in this process. In a data-loader worker: they
    are the main process's to act on; Slurm sends them to every process of the job step, and a
    worker killed by one (torch's worker handler for SIGTERM ends it) makes the main process
    fail with "DataLoader worker ... is killed by signal" instead of stopping cleanly (the main
    process ends its workers itself). At exit: a late signal (submit_pm.sh repeats its warning
    until the ranks end) must not kill the exiting process, as the default handlers that Python
    restores while it shuts down would."""
    for number in installed if numbers is None else numbers:
        signal.signal(number, signal.SIG_IGN)


@contextlib.contextmanager
def held(numbers):
    """Signals ``numbers`` held back (blocked, not lost) in this thread while inside: a process
    started meanwhile starts with them blocked, so that it can ignore them (``release_ignored``)
    before one reaches a handler it inherited or the default one, which would end it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release_ignored(numbers):
    """In a process started under ``held(numbers)``: ignore those signals, then unblock them (one
    that came meanwhile is dropped)."""
    ignore_stop_signals(numbers)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)
