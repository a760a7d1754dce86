"""Command-line pieces shared by flowrl's commands: one-line usage errors, argument types, and checks of
input and output paths made before any work starts.

Every command prints a :class:`UsageError` as ``flowrl <cmd>: error: <cause>; <fix>`` and exits with 2.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import argparse
import math
import os
import tempfile
from pathlib import Path

__all__ = ["UsageError", "OneLineParser", "positive_int", "bounded_int", "finite_float", "device_arg",
           "output_file", "output_dir", "read_text_file", "one_line", "MAX_TEXT_FILE_BYTES"]

MAX_TEXT_FILE_BYTES = 256 * 2 ** 20  # prompt and config files: far more than any real one


class UsageError(FlowrlError):
    """A mistake on the command line; commands print it as one line and exit with code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``UsageError`` (one line, no usage dump) instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{message}; see `{self.prog} --help`")


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(text).split())


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def bounded_int(low: int, high: int, why: str = ""):
    """argparse type: an integer in ``[low, high]``; ``why`` explains the upper bound in the error."""

    expected = f"a positive integer up to {high}" if low == 1 else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not low <= value <= high:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}{reason}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan`` and ``inf`` are mistakes, not settings)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def device_arg(text: str | None):
    """``--device`` as a ``torch.device`` (None: cuda when available, else cpu); a device that cannot be
    used here is a ``UsageError`` naming the fix."""
    from flowrl.hardware import resolve_device

    try:
        return resolve_device(text)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _writable_folder(folder: Path, flag: str, text: str) -> None:
    """Create ``folder`` if needed and prove a file can be created in it (root ignores permission bits,
    and read-only file systems only say so on a write, so the check writes)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"cannot write {flag} {text!r}: {str(probe)!r} is not a folder; choose a path inside a "
                         "folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the folder {str(folder)!r} for {flag} ({err.strerror or err}); choose a "
                         "writable location") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".flowrl-write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"cannot write {flag} {text!r}: the folder {str(folder)!r} is not writable "
                         f"({err.strerror or err}); choose a writable folder") from None


def output_file(text: str, *, flag: str = "--out", suffixes: tuple[str, ...] = (), what: str = "the output") -> Path:
    """A file the command will write: checked (and its folder created) before any work starts.

    Raises:
        UsageError: the path is a folder, has the wrong suffix, lies under a file (``/dev/null/x``) or in a
            folder that cannot be written.
    """
    path = Path(text)
    ending = f" ending in {' or '.join(suffixes)}" if suffixes else ""
    if path.is_dir():
        raise UsageError(f"{flag} {text!r} is a directory; give a file name{ending}")
    if suffixes and path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {text!r}: {what} must end in {' or '.join(suffixes)}; choose a file name with "
                         "one of these endings")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {text!r} is not a regular file; give a file name{ending}")
    _writable_folder(path.parent, flag, text)
    return path


def output_dir(text: str, *, flag: str = "--out") -> Path:
    """A folder the command will write into: created and checked before any work starts."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {text!r} is a file; give a directory")
    _writable_folder(path, flag, text)
    return path


def read_text_file(path: str | os.PathLike, *, what: str, fix: str, max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of a prompt or config file, or a ``UsageError`` naming what is wrong with it.

    Args:
        what: how the message names the file, e.g. ``"--prompts 'p.txt'"``.
        fix: what the user should give instead, e.g. ``"give a text file with one prompt per line"``.
    """
    file = Path(path)
    try:
        size = file.stat().st_size
        if file.is_dir():
            raise UsageError(f"{what} is a folder; {fix}")
        if size > max_bytes:
            raise UsageError(f"{what} is {size} bytes, over the {max_bytes}-byte limit for text files; {fix}")
        data = file.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{what} does not exist; {fix}") from None
    except OSError as err:
        raise UsageError(f"cannot read {what} ({err.strerror or err}); {fix}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{what} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                         f"{fix}") from None
