"""Command-line pieces shared by flowrl's commands: one-line usage errors and argument types."""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "OneLineParser", "positive_int", "device_arg"]


class UsageError(Exception):
    """A mistake on the command line; commands print it as one line and exit with code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``UsageError`` (one line, no usage dump) instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def device_arg(text: str | None):
    """``--device`` as a ``torch.device`` (None: cuda when available, else cpu); a device that cannot be
    used here is a ``UsageError`` naming the fix."""
    from flowrl.runtime import resolve_device

    try:
        return resolve_device(text)
    except ValueError as err:
        raise UsageError(str(err)) from None
