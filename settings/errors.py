"""Errors caused by user input. Entry scripts print their message on one line and exit non-zero
(2 for configuration, 1 for data and training), without a traceback."""
import argparse
import os
import sys


class UserError(Exception):
    exit_code = 1
    every_rank = False  # raised alike on every rank of a launch: rank 0 alone prints it


class ConfigError(UserError, ValueError):
    """A setting is unknown, mistyped or inconsistent."""

    exit_code = 2


class DataError(UserError):
    """Data files are missing, malformed, or hold non-finite values."""


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss became NaN); checkpoints already written are kept."""


def print_error(message: str, prefix: str = "", every_rank: bool = False):
    """``<prefix>error: <message>`` on stderr in one write: ranks that share a stream (torchrun
    runs them unbuffered) then never join two lines (print writes the line and its newline
    apart). ``every_rank``: the same error ends every rank (the same settings, or an outcome the
    ranks agreed on), and only rank 0 (RANK, set by torchrun and export_DDP_vars.sh) prints it:
    one line above torchrun's report, not one per rank."""
    if every_rank and os.environ.get("RANK", "0") not in ("", "0"):
        return
    sys.stderr.write(f"{prefix}error: {message}\n")
    sys.stderr.flush()


def on_every_rank(error: UserError) -> UserError:
    """``error``, marked as raised alike on every rank of a launch (``print_error``)."""
    error.every_rank = True
    return error


def refuse(message: str):
    """End a command-line program on bad input: its one ``error:`` line (the same on every rank
    of a launch: rank 0's), exit code 2."""
    print_error(message, every_rank=True)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser that refuses bad arguments in one ``error:`` line naming ``--help``
    (no usage block), exit code 2."""

    def error(self, message):
        refuse(f"{message} ({self.prog} --help lists the options)")


def at_least(low, kind=int):
    """An argparse ``type``: a ``kind`` (int or float) of ``low`` or more."""
    def parse(text: str):
        try:
            value = kind(text)
            if value != value:  # NaN
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}: give {low} or more")
        return value
    parse.__name__ = f"{kind.__name__} >= {low}"
    return parse


def new_file(text: str) -> str:
    """An argparse ``type``: a new output file (never written over) in an existing directory."""
    if os.path.lexists(text):
        raise argparse.ArgumentTypeError(f"{text} exists: choose another name, or remove it")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: no directory {parent}: create it first")
    return text


def counts(low: int, example: str, why: str = ""):
    """An argparse ``type``: comma-separated integers of ``low`` or more, as a list (``why``: said
    of a number that is too small)."""
    def parse(text: str) -> list[int]:
        out = []
        for item in text.split(","):
            try:
                n = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not an integer: give "
                                                 f"counts such as {example}") from None
            if n < low:
                raise argparse.ArgumentTypeError(f"{text!r}: {n}{why}: give counts of {low} or "
                                                 f"more, e.g. {example}")
            out.append(n)
        return out
    parse.__name__ = f"counts >= {low}"
    return parse
