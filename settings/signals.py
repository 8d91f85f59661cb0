"""The stop signals as the settings name them: the ``stop_signals`` setting's names checked
before torch loads, and the exit code of a run they stopped. What acts on them is
``engine.stop``."""
from __future__ import annotations

import signal

from settings.errors import ConfigError

STOPPED_EXIT_CODE = 3  # "stopped on a signal, resumable": distinct from 0, 1 (failure), 2 (usage)
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_number(name: str) -> int:
    """``SIGTERM``, ``TERM`` or ``sigterm`` as a signal number; ConfigError when not a signal
    that a process can catch."""
    full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    number = signal.Signals.__members__.get(full)
    if number is None or full in _UNCATCHABLE:
        raise ConfigError(f"stop_signals: {name!r} is not a signal a run can catch: use names "
                          f"such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT (not SIGKILL or SIGSTOP)")
    return int(number)
