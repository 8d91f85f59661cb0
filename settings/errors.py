"""Errors caused by user input. Entry scripts print their message on one line and exit non-zero
(2 for configuration, 1 for data and training), without a traceback."""


class UserError(Exception):
    exit_code = 1


class ConfigError(UserError, ValueError):
    """A setting is unknown, mistyped or inconsistent."""

    exit_code = 2


class DataError(UserError):
    """Data files are missing, malformed, or hold non-finite values."""


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss became NaN); checkpoints already written are kept."""
